"""A node that goes silent: its survivors restart at once, and it fences and rejoins when back.

Three agents on 127.0.0.1 run one elastic job (nodes = "1:3"). The node
holding global rank 0 (and the workers' TCPStore) is frozen with its whole
process tree (SIGSTOP): its sockets stay open, so its peers see no FIN or
RST, as with a host that loses power. ``hang_timeout`` is 300 s and torch's
own keep-alive and last call are long, so only marind's node-loss handling
can explain the survivors training again within the test's waits: its lease
expires, the survivors mark it lost for the rendezvous and restart into a new
round of two. SIGCONT brings it back with stale processes: its agent fences
them (SIGKILL), registers anew and rejoins; the job grows back to three nodes
and succeeds.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from marind.cli import main
from marind.control.events import list_events
from marind.core.lease_file import read_lease
from marind.core.rdzv_keys import lost_prefix, members_key
from marind.testing.procs import running
from tests.agent.helpers import agent_log, done_record, job_state, node_registered, start_agent, tiny_spec, wait_for

# long keep-alive expiry and last call: torch alone would not drop the node or re-form quickly
SLOW_RDZV = "last_call_timeout=120,keep_alive_interval=20,keep_alive_max_attempt=3,join_timeout=300"
NODES = ("a", "b", "c")


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def _events(client, job: str) -> list[dict]:
    return list_events(client, job)


def _progress(client, job: str) -> dict:
    return client.get_json(client.key("jobs", job, "progress")) or {}


@pytest.mark.slow     # ~110 s; CI has its 2-host form on the bed (tests/chaos/test_host_scenarios.py (a))
def test_silent_loss_of_the_rank0_node_then_fence_and_rejoin(tmp_path, etcd, etcd_client, etcd_prefix, capsys,
                                                              monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    env = {"MARIND_TEST_STEP_SLEEP": "0.3", "MARIND_LEASE_TTL": "6", "MARIND_RDZV_CONF": SLOW_RDZV}
    agents = {n: start_agent(tmp_path, n, etcd.endpoint, etcd_prefix, env=env) for n in NODES}
    diag = lambda: "\n".join(f"--- {n} ---\n{agent_log(tmp_path, n)}" for n in NODES)
    wait_for(lambda: all(node_registered(etcd_client, n) for n in NODES), 30, "three nodes registered", diag=diag)

    steps = 300
    spec = tiny_spec(tmp_path, name="silent", nodes="1:3", nproc=1, steps=steps, max_restarts=10,
                     hang_timeout="300s")
    spec.write_text(spec.read_text().replace("global_batch = 8", "global_batch = 12"))   # 1, 2 or 3 nodes
    assert main(["submit", str(spec)]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]
    diag_job = lambda: f"{job_state(etcd_client, job)}\n{_progress(etcd_client, job)}\n{_events(etcd_client, job)}\n{diag()}"
    wait_for(lambda: (p := _progress(etcd_client, job)).get("world_size") == 3 and p.get("step", 0) >= 5, 180,
             "the job running on three nodes", diag=diag_job)

    def rank0_node():
        for n in NODES:
            rec = etcd_client.get_json(etcd_client.key("jobs", job, "nodes", n)) or {}
            if any(w.get("rank") == 0 for w in rec.get("workers", [])):
                return n, rec
        return None
    victim, record = wait_for(rank0_node, 30, "the node of global rank 0", diag=diag_job)
    # every node's workers may commit while its lease lives (marind/core/lease_file.py)
    assert all((read_lease(tmp_path / f"state-{n}" / "jobs" / job) or 0) > time.time() for n in NODES)
    frozen = _tree(agents[victim].pid)
    assert record["torchrun_pid"] in {p.pid for p in frozen}
    try:
        _signal_all(frozen, signal.SIGSTOP)             # silent: no FIN, no RST, no more renewals
        stopped_at = _progress(etcd_client, job).get("step", 0)
        wait_for(lambda: (p := _progress(etcd_client, job)).get("world_size") == 2
                 and p.get("step", 0) >= stopped_at + 5, 150,
                 "the survivors training again in a world of two (hang_timeout is 300 s)", diag=diag_job)
        lost = [e for e in _events(etcd_client, job) if e["kind"] == "node_lost"]
        assert len(lost) == 1, lost
        assert lost[0]["detail"]["node"] == victim
        assert lost[0]["detail"]["cause"] == "host_silent" and lost[0]["detail"]["action"] == "restart"
        assert etcd_client.get_prefix_keys(etcd_client.key("jobs", job, "rdzv", "lost") + "/")

        before = {e["kind"] for e in _events(etcd_client, job)}
        _signal_all(frozen, signal.SIGCONT)             # back, with stale processes
        wait_for(lambda: not any(p.is_running() and running(p.pid) for p in frozen[1:]), 60, "the stale torchrun and workers fenced", diag=diag_job)
        assert "host_fenced" not in before
        wait_for(lambda: _progress(etcd_client, job).get("world_size") == 3, 150,
                 "the job grown back to three nodes", diag=diag_job)
    finally:
        _signal_all(frozen, signal.SIGCONT)
    wait_for(lambda: job_state(etcd_client, job).get("state") == "SUCCEEDED", 240, f"{job} SUCCEEDED",
             diag=diag_job)
    assert done_record(spec)["step"] == steps
    events = _events(etcd_client, job)
    kinds = [e["kind"] for e in events]
    assert kinds.count("node_lost") == 1, kinds
    assert "hang_detected" not in kinds, kinds
    fenced = [e for e in events if e["kind"] == "host_fenced"]
    assert len(fenced) == 1 and fenced[0]["node"] == victim and fenced[0]["detail"]["new_lease"] is True, fenced
    rejoined = [e for e in events if e["kind"] == "node_rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["node"] == victim, rejoined
    assert kinds.index("host_fenced") < kinds.index("node_rejoined")
    assert agents[victim].poll() is None, "the fenced agent lives on"


def test_a_torchrun_that_exits_because_it_was_declared_lost_is_fenced_not_failed(tmp_path, etcd, etcd_client,
                                                                                   etcd_prefix, capsys, monkeypatch):
    """The order a frozen host may come back in: its torchrun learns it was declared lost and exits
    before its agent's fence test runs. The marker is written here as a surviving agent writes it
    (``Membership.mark_lost``), then the node's worker is killed so that its torchrun re-enters the
    rendezvous: that exit is a fence (new registration, ``node_rejoined``), never the job's failure."""
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    env = {"MARIND_TEST_STEP_SLEEP": "0.3"}
    nodes = ("a", "b")
    for n in nodes:
        start_agent(tmp_path, n, etcd.endpoint, etcd_prefix, env=env)
    diag = lambda: "\n".join(f"--- {n} ---\n{agent_log(tmp_path, n)}" for n in nodes)
    wait_for(lambda: all(node_registered(etcd_client, n) for n in nodes), 30, "two nodes registered", diag=diag)
    steps = 80
    spec = tiny_spec(tmp_path, name="declared", nodes="1:2", nproc=1, steps=steps, max_restarts=10)
    assert main(["submit", str(spec)]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]
    diag_job = lambda: f"{job_state(etcd_client, job)}\n{_progress(etcd_client, job)}\n{_events(etcd_client, job)}\n{diag()}"
    wait_for(lambda: (p := _progress(etcd_client, job)).get("world_size") == 2 and p.get("step", 0) >= 5, 120,
             "the job running on two nodes", diag=diag_job)
    record = etcd_client.get_json(etcd_client.key("jobs", job, "nodes", "b"))
    member = etcd_client.get_json(members_key(etcd_client, job, "b"))
    assert member["pid"] == record["torchrun_pid"]
    etcd_client.put_json(lost_prefix(etcd_client, job) + member["desc"], {"node": "b", "cause": "lease_expired",
                                                                           "by": "a", "at": time.time()})
    workers = [w["pid"] for w in record["workers"]]
    _signal_all([psutil.Process(pid) for pid in workers], signal.SIGKILL)
    wait_for(lambda: job_state(etcd_client, job).get("state") == "SUCCEEDED", 240, f"{job} SUCCEEDED",
             diag=diag_job)
    events = _events(etcd_client, job)
    kinds = [e["kind"] for e in events]
    assert "failed" not in kinds, kinds
    fenced = [e for e in events if e["kind"] == "host_fenced"]
    assert len(fenced) == 1 and fenced[0]["node"] == "b", fenced
    assert "declared this node lost" in fenced[0]["detail"]["reason"], fenced
    assert fenced[0]["detail"]["new_lease"] is True, fenced
    rejoined = [e for e in events if e["kind"] == "node_rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["node"] == "b", rejoined
    assert done_record(spec)["step"] == steps

"""Two agents as separate nodes run one elastic job (nodes = "1:2").

SIGKILL one agent's whole process tree mid-run: the job re-forms on the
survivor and finishes with the right step count. The killed agent,
restarted on the same state dir, registers again.

Slow (``make chaos``, for CI's time): CI has a node's loss and the survivors' new round in
``tests/chaos/test_host_scenarios.py`` (power-off of the rank-0 host), ``test_silent_node_loss.py``
and the rendezvous's own ``test_torchrun.py``, and an agent registering again in
``test_outage_no_fence.py``.
"""

from __future__ import annotations

import json

import psutil
import pytest

from marind.cli import main
from tests.agent.helpers import agent_log, done_record, job_state, node_registered, start_agent, tiny_spec, wait_for


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.mark.slow
def test_node_loss_and_rejoin(tmp_path, etcd, etcd_client, etcd_prefix, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    env = {"MARIND_TEST_STEP_SLEEP": "0.3"}
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix, env=env)
    b = start_agent(tmp_path, "b", etcd.endpoint, etcd_prefix, env=env)
    diag = lambda: f"--- a ---\n{agent_log(tmp_path, 'a')}\n--- b ---\n{agent_log(tmp_path, 'b')}"
    wait_for(lambda: node_registered(etcd_client, "a") and node_registered(etcd_client, "b"), 30,
             "both nodes registered", diag=diag)

    steps = 60
    spec = tiny_spec(tmp_path, name="elastic", nodes="1:2", nproc=1, steps=steps, max_restarts=10)
    assert main(["submit", str(spec)]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]

    def world_of_two():
        doc = etcd_client.get_json(etcd_client.key("jobs", job, "progress")) or {}
        return doc.get("world_size") == 2 and doc.get("step", 0) >= 3 and doc
    wait_for(world_of_two, 120, "the job running on two nodes", diag=diag)

    _kill_tree(b.pid)                      # node b dies: agent, torchrun and workers at once
    wait_for(lambda: job_state(etcd_client, job).get("restarts", 0) >= 1, 90,
             "the survivor to restart the job", diag=diag)
    b2 = start_agent(tmp_path, "b", etcd.endpoint, etcd_prefix, env=env)
    wait_for(lambda: (r := node_registered(etcd_client, "b")) and r.get("pid") == b2.pid, 30,
             "node b registered again", diag=diag)

    wait_for(lambda: job_state(etcd_client, job).get("state") == "SUCCEEDED", 180, f"{job} SUCCEEDED",
             diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    done = done_record(spec)
    assert done["step"] == steps and done["resumed_from"] > 0
    assert main(["status", job, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["jobs"][0]
    assert row["step"] == steps and row["restarts"] >= 1
    kinds = [e["kind"] for e in etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/").values()]
    assert "restart" in kinds and kinds.count("node_joined") >= 2
    assert kinds.count("node_lost") == 1, kinds

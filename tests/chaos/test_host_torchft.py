"""torchft mode on the multi-host bed: a host powered off and back, a host's network partitioned and healed.

A torchft job (``[fault] mode = "torchft"``) runs one replica group (one rank)
per bed host under the real ``marind agent``, checkpoints on the bed's S3; the
lighthouse runs beside one agent. The victim is a group's host or the
lighthouse's. Each scenario asserts: the surviving groups' step counter
advanced while the victim was away (their progress records) and the lighthouse
was not the victim's then; the victim's group came back into the quorum past
the step the others reached without it (healed from a peer); the job
SUCCEEDED with every group at the last step and the same parameters; every
committed checkpoint verifies; and the agents' events (``node_lost`` with its
cause and action ``mark``, ``host_fenced``, ``node_rejoined`` where they
apply). All are ``slow`` (``make chaos``; 1-5 min each).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime

import pytest

pytest.importorskip("torchft")

from marind.core.log import get_logger
from marind.testing.s3_server import ACCESS_KEY, SECRET_KEY
from tests.agent.helpers import wait_for
from tests.chaos.test_host_scenarios import (  # noqa: F401 - fixtures
    BedCluster,
    bed_cluster,
    dataset,
    hostbed,
)
from tests.chaos.test_scenarios import _check_checkpoints

pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.timeout(1200)]

log = get_logger("tests.host_torchft")
EVERY = 250
LEASE_TTL = 10      # the agent's default (docs/design.md §8)
STEPS = 3000        # a group alone steps 10-20/s here: the job must outlast the outage and the rejoin by far


def _ft_spec(cluster: BedCluster, name: str, url: str, steps: int, every: int = EVERY, keep_last: int = 0) -> str:
    """The trainer on S3 under torchft: one replica group (one rank) per host, min_replicas 1."""
    groups = len(cluster.nodes)
    text = f"""
[job]
name = "{name}"
nodes = "1:{groups}"
nproc_per_node = 1
max_restarts = 10
entrypoint = "marind.trainer"
[job.env]
AWS_ENDPOINT_URL = "{cluster.s3.endpoint}"
AWS_ACCESS_KEY_ID = "{ACCESS_KEY}"
AWS_SECRET_ACCESS_KEY = "{SECRET_KEY}"
AWS_DEFAULT_REGION = "us-east-1"
OMP_NUM_THREADS = "1"
[model]
preset = "tiny"
[data]
path = "{cluster.data}"
seq_len = 32
global_batch = 2
micro_batch = 2
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {steps}
seed = 7
log_every = 10
[checkpoint]
url = "{url}"
every_steps = {every}
async = true
keep_last = {keep_last}
[fault]
mode = "torchft"
replica_groups = {groups}
min_replicas = 1
timeout = "10s"
quorum_timeout = "20s"
join_timeout = "500ms"
heartbeat_timeout = "2s"
"""
    path = cluster.tmp / f"{name}.toml"
    path.write_text(text)
    return str(path)


def _submit(cluster: BedCluster, name: str, steps: int, every: int = EVERY, keep_last: int = 0) -> tuple[str, str]:
    from marind.cli import main as marind_main
    url = cluster.s3.url(f"bedft-{uuid.uuid4().hex[:8]}", name)
    cluster.capsys.readouterr()
    rc = marind_main(["submit", _ft_spec(cluster, name, url, steps, every, keep_last)])
    out = cluster.capsys.readouterr().out
    assert rc == 0, out
    job = out.strip().splitlines()[-1]
    cluster.__dict__.setdefault("jobs", {})[url] = job     # _check_checkpoints runs the history checker on it
    return job, url


def _progress(cluster: BedCluster, node: str, job: str) -> dict:
    """Node ``node``'s group's rank-0 progress record (``{}`` until there is one)."""
    try:
        return json.loads((cluster.tmp / f"state-{node}" / "jobs" / job / "progress" / "rank-0.json").read_text())
    except (OSError, ValueError):
        return {}


def _all_stepping(cluster: BedCluster, job: str, past: int) -> None:
    n = len(cluster.nodes)
    wait_for(lambda: all(_progress(cluster, h, job).get("participants") == n
                         and _progress(cluster, h, job).get("step", 0) >= past for h in cluster.nodes),
             600, f"all {n} groups stepping together past step {past}", interval=0.2, diag=cluster.diag)


def _lighthouse_node(cluster: BedCluster, job: str) -> str:
    rec = cluster.client.get_json(cluster.client.key("jobs", job, "ft", "lighthouse")) or {}
    assert rec.get("node") in cluster.nodes, rec
    return rec["node"]


def _victim(cluster: BedCluster, job: str) -> str:
    holder = _lighthouse_node(cluster, job)
    return sorted(n for n in cluster.nodes if n != holder)[-1]


def _survivors_step_during(cluster: BedCluster, job: str, victim: str, min_s: float = 20.0,
                           max_s: float = 150.0) -> dict[str, tuple[int, int]]:
    """Keep the fault on for ``min_s`` seconds, and on until every survivor's step advanced (at most
    ``max_s``): {node: (step at the fault, step at its end)}."""
    survivors = [n for n in cluster.nodes if n != victim]
    start = {n: _progress(cluster, n, job).get("step", 0) for n in survivors}
    time.sleep(min_s)
    wait_for(lambda: all(_progress(cluster, n, job).get("step", 0) > start[n] for n in survivors), max_s - min_s,
             f"the survivors stepping without {victim} (at {start})", interval=0.5, diag=cluster.diag)
    return {n: (start[n], _progress(cluster, n, job).get("step", 0)) for n in survivors}


def _rejoined_and_stepping(cluster: BedCluster, job: str, victim: str, old_pid: int | None, after_step: int) -> dict:
    """The victim's group is back in a quorum with every group, past ``after_step`` (with ``old_pid``:
    in a new worker)."""
    n = len(cluster.nodes)
    return wait_for(lambda: (p := _progress(cluster, victim, job)).get("pid") not in (None, old_pid)
                    and p.get("participants") == n and p.get("step", 0) > after_step and p,
                    300, f"{victim}'s group back in the quorum", interval=0.2, diag=cluster.diag)


def _healed_since(cluster: BedCluster, job: str, node: str, since: float) -> list[dict]:
    """The ``healed_from_peer`` records of ``node``'s trainer logged after ``since`` (Unix time)."""
    path = cluster.tmp / f"state-{node}" / "jobs" / job / "logs" / "torchrun.log"
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if '"event": "healed_from_peer"' in line and line.startswith("{"):
            rec = json.loads(line)
            if datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp() > since:
                out.append(rec)
    return out


def _finish(cluster: BedCluster, job: str, url: str, steps: int) -> None:
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps)
    finals = {n: _progress(cluster, n, job) for n in cluster.nodes}
    assert {p.get("step") for p in finals.values()} == {steps}, finals
    digests = {n: p.get("param_digest") for n, p in finals.items()}
    assert len(set(digests.values())) == 1, f"the groups ended with different parameters: {digests}"


def _events_of(cluster: BedCluster, job: str, kind: str, victim: str) -> list[dict]:
    return [e for e in cluster.kinds(job, kind)
            if e.get("node") == victim or (e.get("detail") or {}).get("node") == victim]


# -- (i) power off a group's host, and back: its stale processes fenced, its group heals ------------

@pytest.mark.parametrize(("hostbed", "whom"), [
    pytest.param(("host1", "host2", "host3"), "peer", id="3hosts-peer"),
    pytest.param(("host1", "host2", "host3"), "lighthouse", id="3hosts-lighthouse"),
], indirect=["hostbed"])
def test_torchft_power_off_and_back(bed_cluster, whom):  # noqa: F811 - the fixture
    """Its lease expires, the others record it lost and step on (on a lighthouse of their own where it
    held theirs). Powered on, its agent finds its lease lapsed and either fences its stale group (its
    worker had made no progress: the group starts again and heals from a peer, ``host_fenced`` and
    ``node_rejoined``) or, when the resumed worker reported progress before the agent looked (the
    fence rule of docs/design.md §1: workers that step are not fenced), leaves it: that worker's quorum
    fails on its gone lighthouse, it follows the new one and torchft heals it from a peer (or torchrun
    restarts it). Either way it is back in the quorum past the step the others reached without it."""
    cluster = bed_cluster
    steps = STEPS
    job, url = _submit(cluster, "ft-power", steps)
    _all_stepping(cluster, job, 10)
    victim = _lighthouse_node(cluster, job) if whom == "lighthouse" else _victim(cluster, job)
    old_pid = _progress(cluster, victim, job)["pid"]
    off_at = time.time()
    frozen = cluster.bed.power_off(victim)
    assert frozen, f"nothing ran in {victim}"
    try:
        seen = _survivors_step_during(cluster, job, victim)    # past the lease TTL: it is lost
        assert _lighthouse_node(cluster, job) != victim, "the lighthouse stayed with the powered-off host"
    finally:
        cluster.bed.power_on(victim, frozen)
    assert all(end > start for start, end in seen.values()), f"the survivors stalled: {seen}\n{cluster.diag()}"
    back = _rejoined_and_stepping(cluster, job, victim, None, max(end for _, end in seen.values()))
    fenced = _events_of(cluster, job, "host_fenced", victim)
    log.info("victim_back", victim=victim, step=back["step"], pid=back["pid"], old_pid=old_pid, fenced=len(fenced))
    _finish(cluster, job, url, steps)
    events = cluster.events(job)
    lost = _events_of(cluster, job, "node_lost", victim)
    assert len(lost) == 1 and lost[0]["detail"]["cause"] == "lease_expired", events
    assert lost[0]["detail"]["action"] == "mark" and not lost[0]["detail"].get("killed"), lost
    if fenced:
        assert len(fenced) == 1 and len(_events_of(cluster, job, "node_rejoined", victim)) == 1, events
        assert back["pid"] != old_pid, "fenced, yet the stale worker runs on"
        assert _healed_since(cluster, job, victim, off_at), "the restarted group joined without healing from a peer"
    assert not cluster.kinds(job, "hang_detected") and not cluster.kinds(job, "group_failed"), events


def _commits_between(cluster: BedCluster, job: str, node: str, start: float, end: float) -> list[int]:
    """The steps whose checkpoint ``node``'s group committed between ``start`` and ``end`` (Unix times)."""
    path = cluster.tmp / f"state-{node}" / "jobs" / job / "logs" / "torchrun.log"
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        if '"event": "ckpt_committed"' in line and line.startswith("{"):
            rec = json.loads(line)
            if rec.get("rank") == 0 and start < datetime.fromisoformat(
                    rec["timestamp"].replace("Z", "+00:00")).timestamp() < end:
                steps.append(int(rec["step"]))
    return steps


@pytest.mark.parametrize("hostbed", [("host1", "host2")], indirect=True)
def test_torchft_survivor_commits_before_the_lost_hosts_lease_expires(bed_cluster):  # noqa: F811 - the fixture
    """Two hosts, the one without the lighthouse powered off: the survivor reaches no data-network peer,
    so its agent fences its commits (it could be the one cut off); once etcd shows the lost host's
    lease unrenewed past its silent window (dead, not this node cut off), the fence lifts and the
    survivor's group commits checkpoints again before that lease expires, not after (the fence held
    until the expiry before: every save of those ~10 s failed, and training stalled behind them)."""
    cluster = bed_cluster
    steps = 1500
    job, url = _submit(cluster, "ft-fence", steps, every=10, keep_last=3)
    _all_stepping(cluster, job, 10)
    victim = _victim(cluster, job)
    survivor = next(n for n in cluster.nodes if n != victim)
    off_at = time.time()
    frozen = cluster.bed.power_off(victim)
    assert frozen, f"nothing ran in {victim}"
    try:
        lost = wait_for(lambda: _events_of(cluster, job, "node_lost", victim), 60, f"{victim} recorded lost",
                        interval=0.2, diag=cluster.diag)
    finally:
        cluster.bed.power_on(victim, frozen)
    lost_at = float(lost[0]["at"])
    assert lost[0]["detail"]["cause"] == "lease_expired" and lost_at - off_at > 6, lost
    committed = _commits_between(cluster, job, survivor, off_at + 5.0, lost_at)
    assert committed, (f"no checkpoint committed by {survivor} between the fence's lifting and {victim}'s lease "
                       f"expiry ({lost_at - off_at:.1f} s after the power-off)\n{cluster.diag()}")
    _rejoined_and_stepping(cluster, job, victim, None, max(committed))
    _finish(cluster, job, url, steps)
    assert not cluster.kinds(job, "hang_detected") and not cluster.kinds(job, "group_failed"), cluster.events(job)


# -- (ii) partition a group's host's data network, then heal --------------------------------------

@pytest.mark.parametrize(("hostbed", "whom"), [
    pytest.param(("host1", "host2"), "peer", id="2hosts-peer"),
    pytest.param(("host1", "host2", "host3"), "lighthouse", id="3hosts-lighthouse"),
], indirect=["hostbed"])
def test_torchft_data_partition_and_heal(bed_cluster, whom):  # noqa: F811 - the fixture
    """The cut-off group stalls (its quorum and all-reduce cannot reach the others); the others step on,
    and once the link is back it joins their quorum again, healing from a peer. With the lighthouse's
    host cut off, the lighthouse must move to the connected side for the others to step."""
    cluster = bed_cluster
    steps = STEPS
    job, url = _submit(cluster, "ft-data-cut", steps)
    _all_stepping(cluster, job, 10)
    victim = _lighthouse_node(cluster, job) if whom == "lighthouse" else _victim(cluster, job)
    old_pid = _progress(cluster, victim, job)["pid"]
    cut_at = time.time()
    cluster.bed.cut(victim, "data")
    try:
        seen = _survivors_step_during(cluster, job, victim)
        assert _lighthouse_node(cluster, job) != victim, "the lighthouse stayed with the cut-off host"
    finally:
        cluster.bed.restore(victim, "data")
    assert all(end > start for start, end in seen.values()), f"the survivors stalled: {seen}\n{cluster.diag()}"
    back = _rejoined_and_stepping(cluster, job, victim, None, max(end for _, end in seen.values()))
    log.info("victim_back", victim=victim, step=back["step"], pid=back["pid"], old_pid=old_pid)
    assert _healed_since(cluster, job, victim, cut_at), "the cut-off group rejoined without healing from a peer"
    _finish(cluster, job, url, steps)
    events = cluster.events(job)
    lost = _events_of(cluster, job, "node_lost", victim)
    assert len(lost) == 1, events
    assert lost[0]["detail"]["cause"] == "data_network_gone" and lost[0]["detail"]["action"] == "mark", lost
    assert not lost[0]["detail"]["killed"], "a torchft survivor restarts nothing"
    assert len(_events_of(cluster, job, "host_fenced", victim)) == 1, events
    assert len(_events_of(cluster, job, "node_rejoined", victim)) == 1, events
    assert not cluster.kinds(job, "hang_detected") and not cluster.kinds(job, "group_failed"), events
    survivors = [n for n in cluster.nodes if n != victim]
    assert cluster.restarts_per_node(job) == {n: 0 for n in cluster.nodes}, events
    assert not [e for e in cluster.kinds(job, "host_fenced") if e["node"] in survivors], events


# -- (iii) partition a group's host's control network (etcd and S3) past its lease TTL, then heal -----

def test_torchft_control_partition_and_heal(bed_cluster):  # noqa: F811 - the fixture
    """The victim's lease expires: the others record it lost (``lease_expired``, mark) and restart nothing;
    its group still reaches the others' and the lighthouse on the data network. Once etcd is back its agent
    registers anew and holds (or takes again) a group slot; the job ends with every group at the last step."""
    cluster = bed_cluster
    steps = STEPS
    job, url = _submit(cluster, "ft-ctl-cut", steps)
    _all_stepping(cluster, job, 10)
    victim = _victim(cluster, job)
    old_pid = _progress(cluster, victim, job)["pid"]
    cluster.bed.cut(victim, "control")
    try:
        seen = _survivors_step_during(cluster, job, victim, min_s=LEASE_TTL + 8)
    finally:
        cluster.bed.restore(victim, "control")
    assert all(end > start for start, end in seen.values()), f"the survivors stalled: {seen}\n{cluster.diag()}"
    back = _rejoined_and_stepping(cluster, job, victim, None, max(end for _, end in seen.values()))
    log.info("victim_back", victim=victim, step=back["step"], pid=back["pid"], old_pid=old_pid)
    _finish(cluster, job, url, steps)
    events = cluster.events(job)
    log.info("events", events=[(e["kind"], e.get("node"), (e.get("detail") or {}).get("node")) for e in events])
    lost = _events_of(cluster, job, "node_lost", victim)
    assert len(lost) == 1 and lost[0]["detail"]["cause"] == "lease_expired", events
    assert lost[0]["detail"]["action"] == "mark" and not lost[0]["detail"].get("killed"), lost
    assert not cluster.kinds(job, "hang_detected") and not cluster.kinds(job, "group_failed"), events

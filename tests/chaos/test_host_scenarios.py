"""Chaos scenarios on the multi-host bed: hosts that lose power or a network, seen from a live job.

Each host of the bed (``marind.testing.hosts``, docs/design.md §12) runs a
real ``marind agent`` with the real trainer (2 ranks) on real S3; etcd and
S3 are on the control network, the workers' store and collectives on the
data network. Each scenario asserts that the job reaches SUCCEEDED, that
every committed checkpoint verifies, the final state (bit-identical to a
fault-free run where the world size never changed, the loss curve within
``LOSS_TOLERANCE`` where it did), and the events: ``node_lost`` with its
cause, ``host_fenced``, ``node_rejoined``, one recovery per fault.

CI runs ``test_power_off_forever_of_the_rank0_host`` reduced (no fault-free
baseline: the loss curve is checked against the run's own first world); the
others, and the full form, are ``slow`` (``make chaos``).
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from marind.core.log import get_logger
from marind.testing.chaos import host_faults
from marind.testing.hosts import HostBed
from tests.agent.helpers import agent_log, node_registered, wait_for
from tests.chaos.test_scenarios import (
    EVERY,
    LOSS_TOLERANCE,
    Cluster,
    _check_checkpoints,
    _spec,
    final_tensor_objects,
)
from tests.hosts.conftest import require_bed

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(1500)]

log = get_logger("tests.host_scenarios")
FULL = os.environ.get("MARIND_FULL") == "1"
LEASE_TTL = 10          # the agent's default (docs/design.md §8)
ETCD_GRACE = 30         # torchrun's etcd_grace_timeout default (§5)


@pytest.fixture
def hostbed(request, tmp_path):
    require_bed()
    names = getattr(request, "param", ("host1", "host2"))
    bed = HostBed(tmp_path / "bed", list(names), s3=True).start()
    try:
        yield bed
    finally:
        bed.close()
    assert bed.leftovers() == []


class BedCluster(Cluster):
    """``Cluster`` of test_scenarios with one agent per bed host (node name = hostname)."""

    def __init__(self, bed: HostBed, client, prefix: str, data: str, capsys, monkeypatch):
        self.bed = bed
        self.tmp, self.client, self.prefix = bed.root, client, prefix
        self.s3, self.data, self.capsys, self.nodes = bed.s3, data, capsys, tuple(bed.names)
        monkeypatch.setenv("MARIND_ETCD", bed.plan.etcd)
        monkeypatch.setenv("MARIND_PREFIX", prefix)
        for name in bed.names:
            bed.start_agent(name, prefix)
        for name in bed.names:
            wait_for(lambda n=name: node_registered(client, n), 60, f"{name} registered", diag=self.diag)

    def diag(self) -> str:
        return "\n".join(f"--- {n} ---\n{agent_log(self.tmp, n)}" for n in self.nodes)

    def restart_agent(self, node: str) -> None:
        self.bed.start_agent(node, self.prefix)
        wait_for(lambda: node_registered(self.client, node), 60, f"{node} registered again", diag=self.diag)

    def host_of_rank(self, job: str, rank: int = 0) -> str:
        """The node whose record lists global rank ``rank`` among its workers."""
        recs = self.client.get_prefix_json(self.client.key("jobs", job, "nodes") + "/")
        for key, rec in recs.items():
            if any(isinstance(w, dict) and w.get("rank") == rank for w in rec.get("workers") or []):
                return key.rsplit("/", 1)[-1]
        raise AssertionError(f"no node of {job} holds rank {rank}: {recs}")

    def kinds(self, job: str, kind: str) -> list[dict]:
        return [e for e in self.events(job) if e["kind"] == kind]


@pytest.fixture
def bed_cluster(hostbed, etcd_prefix, dataset, capsys, monkeypatch):
    from marind.core.etcd_client import EtcdClient
    with EtcdClient(hostbed.plan.etcd, prefix=etcd_prefix) as client:
        yield BedCluster(hostbed, client, etcd_prefix, dataset, capsys, monkeypatch)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from marind.trainer.data import corpus
    prefix = tmp_path_factory.mktemp("bed-data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


def _submit(cluster: BedCluster, name: str, nodes: str, steps: int, hang_timeout: str = "300s",
            every: int = EVERY):
    """Submit the trainer spec of test_scenarios on the bed's S3 (default hang_timeout: nothing but
    node-loss handling may recover a silent host in time)."""
    from marind.cli import main as marind_main
    url = cluster.s3.url(f"bed-{uuid.uuid4().hex[:8]}", name)
    cluster.capsys.readouterr()
    rc = marind_main(["submit", _spec(cluster.tmp, name, cluster.data, url, cluster.s3, nodes,
                                      hang_timeout=hang_timeout, steps=steps, every=every,
                                      global_batch=24 if len(cluster.nodes) == 3 else 8)])
    out = cluster.capsys.readouterr().out
    assert rc == 0, out
    job = out.strip().splitlines()[-1]
    cluster.__dict__.setdefault("jobs", {})[url] = job     # _check_checkpoints runs the history checker on it
    return job, url


def _baseline(cluster: BedCluster, nodes: str, steps: int, every: int = EVERY) -> dict:
    job, url = _submit(cluster, "baseline", nodes, steps, every=every)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url, steps)
    return {"objects": final_tensor_objects(store, url, cluster.s3), "losses": cluster.losses(job)}


def _training_on_all(cluster: BedCluster, job: str, past_step: int, world: int | None = None) -> None:
    world = world or 2 * len(cluster.nodes)
    wait_for(lambda: cluster.world_size(job) == world and cluster.step(job) >= past_step, 600,
             f"{job} training on {world} ranks past step {past_step}", interval=0.2, diag=cluster.diag)


def _assert_losses_close(losses: dict[int, float], expected: dict[int, float], steps: int) -> None:
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)
    worst = max(abs(losses[s] - expected[s]) for s in expected)
    assert worst <= LOSS_TOLERANCE, f"the loss curve left the fault-free one by {worst:.4f}"


def _restored(cluster: BedCluster, job: str) -> list[dict]:
    """The trainers' ``restored`` records of ``job`` (every host, every run)."""
    out = []
    for path in cluster.tmp.glob(f"state-*/jobs/{job}/logs/torchrun.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"event": "restored"' in line and "{" in line:
                out.append(json.loads(line[line.index("{"):]))
    assert out, f"no restore in {job}'s logs"
    return out


def _lost_events(cluster: BedCluster, job: str, node: str) -> list[dict]:
    return [e for e in cluster.kinds(job, "node_lost") if (e.get("detail") or {}).get("node") == node]


def _cut_data_until_recovered(cluster: BedCluster, job: str, victim: str) -> int:
    """Cut ``victim``'s data link until the others acted on it (its ``node_lost``, or a hang), then
    heal it; the step at the cut."""
    cluster.bed.cut(victim, "data")
    cut_at = cluster.step(job)
    try:
        wait_for(lambda: _lost_events(cluster, job, victim) or cluster.kinds(job, "hang_detected"), 300,
                 "a recovery from the cut data link", interval=0.5, diag=cluster.diag)
    finally:
        cluster.bed.restore(victim, "data")
    return cut_at


# -- (a) power off forever: the host holding global rank 0 and the workers' store --------------------

@pytest.mark.parametrize("hostbed", [pytest.param(("host1", "host2"), id="2hosts"),
                                     pytest.param(("host1", "host2", "host3"), id="3hosts",
                                                  marks=pytest.mark.slow)], indirect=True)
def test_power_off_forever_of_the_rank0_host(bed_cluster):
    cluster = bed_cluster
    steps = 60 if FULL else 36
    nhosts = len(cluster.nodes)
    baseline = _baseline(cluster, f"1:{nhosts}", steps) if FULL else None
    job, url = _submit(cluster, "power-off", f"1:{nhosts}", steps)
    _training_on_all(cluster, job, EVERY + 2)
    victim = cluster.host_of_rank(job, 0)
    frozen = cluster.bed.power_off(victim)
    assert frozen, f"nothing ran in {victim}"
    host_faults.kill_host_processes(cluster.bed.host(victim))
    lost_at = cluster.step(job)
    wait_for(lambda: cluster.world_size(job) == 2 * (nhosts - 1) and cluster.step(job) > lost_at, 300,
             "the survivors training without the lost host", interval=0.2, diag=cluster.diag)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps)
    lost = _lost_events(cluster, job, victim)
    assert len(lost) == 1, cluster.events(job)
    assert lost[0]["detail"]["cause"] == "host_silent", lost
    survivors = [n for n in cluster.nodes if n != victim]
    per_node = cluster.restarts_per_node(job)
    assert all(per_node[n] == 1 for n in survivors), per_node       # one recovery for one fault
    assert not cluster.kinds(job, "hang_detected"), "the loss must be acted on, not left to hang_timeout"
    losses = cluster.losses(job)
    if baseline is not None:
        _assert_losses_close(losses, baseline["losses"], steps)
    else:
        assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)


# -- (b) power off and back: stale processes fenced, the host rejoins, the job grows back -----------
@pytest.mark.slow
def test_power_off_and_back_is_fenced_and_rejoins(bed_cluster):
    cluster = bed_cluster
    steps = 150
    baseline = _baseline(cluster, "1:2", steps)
    job, url = _submit(cluster, "power-back", "1:2", steps)
    _training_on_all(cluster, job, EVERY + 2)
    victim = cluster.host_of_rank(job, 0)
    frozen = cluster.bed.power_off(victim)
    lost_at = cluster.step(job)
    wait_for(lambda: cluster.world_size(job) == 2 and cluster.step(job) > lost_at, 300,
             "the survivor training alone", interval=0.2, diag=cluster.diag)
    cluster.bed.power_on(victim, frozen)
    wait_for(lambda: cluster.kinds(job, "node_rejoined"), 180, f"{victim} rejoined", diag=cluster.diag)
    wait_for(lambda: cluster.world_size(job) == 4, 300, "the job grown back to 4 ranks", interval=0.2,
             diag=cluster.diag)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps)
    assert len(_lost_events(cluster, job, victim)) == 1, cluster.events(job)
    fenced = [e for e in cluster.kinds(job, "host_fenced") if e["node"] == victim]
    assert len(fenced) == 1, cluster.events(job)
    assert [e["node"] for e in cluster.kinds(job, "node_rejoined")] == [victim]
    _assert_losses_close(cluster.losses(job), baseline["losses"], steps)


# -- (c) the data network of one host partitioned, then healed ---------------------------------------
@pytest.mark.slow
def test_data_partition_and_heal(bed_cluster):
    cluster = bed_cluster
    steps = 60
    baseline = _baseline(cluster, "2", steps)
    job, url = _submit(cluster, "data-cut", "2", steps, hang_timeout="60s")
    _training_on_all(cluster, job, EVERY + 2)
    victim = cluster.host_of_rank(job, 2)
    cut_at = _cut_data_until_recovered(cluster, job, victim)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    assert cluster.step(job) > cut_at
    store = _check_checkpoints(cluster, url, steps)
    assert final_tensor_objects(store, url, cluster.s3) == baseline["objects"], \
        "the world size never changed: the final state must be bit-identical to the fault-free run"
    _data_loss_acted_on(cluster, job, victim)


def _data_loss_acted_on(cluster: BedCluster, job: str, victim: str) -> None:
    """A host that lost its data network is recovered from like a lost host (issue 19 §3): one
    ``node_lost`` (cause ``data_network_gone``), not the hang timeout; one restart of each survivor;
    the cut-off host fenced once (no restart of its own) and back (``node_rejoined``)."""
    events = cluster.events(job)
    lost = cluster.kinds(job, "node_lost")
    assert len(lost) == 1 and lost[0]["detail"]["node"] == victim, events
    assert lost[0]["detail"]["cause"] == "data_network_gone" and lost[0]["detail"]["action"] == "restart", lost
    assert not cluster.kinds(job, "hang_detected"), events
    fenced = cluster.kinds(job, "host_fenced")
    assert [e["node"] for e in fenced] == [victim], events
    assert [e["node"] for e in cluster.kinds(job, "node_rejoined")] == [victim], events
    per_node = cluster.restarts_per_node(job)
    assert per_node == {n: 0 if n == victim else 1 for n in cluster.nodes}, (per_node, events)


# -- (d) the control network only, for less than etcd_grace_timeout: no restart -----------------------
@pytest.mark.slow
def test_control_partition_shorter_than_grace_keeps_training(bed_cluster):
    """etcd out of reach of one host for longer than its lease TTL, shorter than etcd_grace_timeout.

    S3 is on the control network too, and a save that cannot reach it stalls the steps (node-loss
    handling then takes the host for lost, and it fences itself): the cut falls between two saves.
    """
    cluster = bed_cluster
    steps, every = 600, 300       # 15 s of steps (~10/s here) stay short of the next save
    baseline = _baseline(cluster, "2", steps, every)
    job, url = _submit(cluster, "ctl-cut", "2", steps, every=every)
    wait_for(lambda: every in cluster.store(url).steps(), 600, f"checkpoint {every} committed", interval=0.5,
             diag=cluster.diag)
    victim = cluster.host_of_rank(job, 2)
    before = cluster.step(job)
    cluster.bed.cut(victim, "control")
    try:
        time.sleep(LEASE_TTL + 5)      # its registration expires; torchrun's etcd calls keep retrying
    finally:
        cluster.bed.restore(victim, "control")
    assert cluster.step(job) > before + 3, "the job stepped on through the control outage"
    assert LEASE_TTL + 5 < ETCD_GRACE
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url, steps)
    assert final_tensor_objects(store, url, cluster.s3) == baseline["objects"]
    assert cluster.restarts_per_node(job) == {n: 0 for n in cluster.nodes}, cluster.events(job)
    assert not cluster.kinds(job, "node_lost") and not cluster.kinds(job, "host_fenced"), cluster.events(job)


@pytest.mark.slow
def test_control_partition_during_a_save_keeps_training(bed_cluster):
    """The rank-0 host loses etcd and S3 in the middle of a save, for longer than its lease TTL.

    The save's upload and commit wait on S3 in the background; the steps go on: a save due
    meanwhile gives up on the storage after ``checkpoint.prepare_timeout`` (2 s) or, once the lease has gone
    unrenewed for TTL/2, is skipped, so no step stalls and nobody takes the host for lost. A
    commit that comes after the lease expired is refused by the commit fence.
    """
    from marind.testing.chaos.ckpt import open_root, wait_for_save
    cluster = bed_cluster
    steps, every = 600, 40        # several saves fall due during the 15 s cut (~6-10 steps/s here)
    baseline = _baseline(cluster, "2", steps, every)
    job, url = _submit(cluster, "ctl-save-cut", "2", steps, every=every)
    _training_on_all(cluster, job, 2)
    victim = cluster.host_of_rank(job, 0)
    fs, root = open_root(url, cluster.s3.storage_options)
    saving = wait_for_save(fs, root, url, 300, log)
    before = cluster.step(job)
    cluster.bed.cut(victim, "control")
    try:
        time.sleep(LEASE_TTL + 5)
    finally:
        cluster.bed.restore(victim, "control")
    assert cluster.step(job) > before + 3, "the job stepped on through the control outage"
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url, steps)
    assert saving > 0
    assert final_tensor_objects(store, url, cluster.s3) == baseline["objects"]
    assert cluster.restarts_per_node(job) == {n: 0 for n in cluster.nodes}, cluster.events(job)
    assert not cluster.kinds(job, "node_lost") and not cluster.kinds(job, "host_fenced"), cluster.events(job)


# -- (e) the rank-0 host's data network cut in the middle of a save -----------------------------------
@pytest.mark.slow
def test_rank0_data_partition_during_a_save(bed_cluster):
    """A replaced world commits nothing and mixes nothing into the new world's checkpoints."""
    from marind.testing.chaos.ckpt import open_root, step_dir_name, wait_for_save
    cluster = bed_cluster
    steps = 60
    baseline = _baseline(cluster, "2", steps)
    job, url = _submit(cluster, "save-cut", "2", steps, hang_timeout="60s")
    _training_on_all(cluster, job, 2)
    victim = cluster.host_of_rank(job, 0)
    # a checkpoint committed first, so the new world restores one: the cut falls in a later save
    # (cut in the first, nothing would be committed and the new world would start from step 0)
    wait_for(lambda: cluster.store(url).steps(), 300, "a first checkpoint committed", interval=0.2, diag=cluster.diag)
    fs, root = open_root(url, cluster.s3.storage_options)
    saving = wait_for_save(fs, root, url, 300, log)
    _cut_data_until_recovered(cluster, job, victim)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url, steps)       # every committed checkpoint verifies
    replaced_at = min(e["at"] for e in cluster.kinds(job, "restart") + cluster.kinds(job, "node_lost"))
    restored = min(r["step"] for r in _restored(cluster, job))
    for step in store.steps():
        manifest = store.manifest(step)
        assert manifest["world"]["world_size"] == 4, manifest.get("world")
        # the replaced world's commits (the manifest's write) all came before it was replaced;
        # the new world's are past the step it restored
        info = fs.info(f"{root}/{step_dir_name(step)}/manifest.json")
        committed_at = info["LastModified"].timestamp()
        assert committed_at < replaced_at or step > restored, (step, committed_at, replaced_at, restored)
    assert saving > 0
    assert final_tensor_objects(store, url, cluster.s3) == baseline["objects"]
    _data_loss_acted_on(cluster, job, victim)


# -- (f) the rank-0 host powered off in the middle of a save, back inside its old lease ---------------
@pytest.mark.slow
def test_power_off_during_a_save_and_back_inside_its_lease(bed_cluster):
    """Declared lost before its lease could expire (``host_silent``), the host resumes with the old world's
    processes while its lease would still be live: its lease was revoked, so its agent fences every run,
    its commit window is over, and nothing it does afterwards is committed or mixed into the new world's."""
    from marind.testing.chaos.ckpt import open_root, step_dir_name, wait_for_save
    cluster = bed_cluster
    steps = 80
    job, url = _submit(cluster, "back-in-lease", "1:2", steps, every=2)
    _training_on_all(cluster, job, 4)
    victim = cluster.host_of_rank(job, 0)
    fs, root = open_root(url, cluster.s3.storage_options)
    wait_for_save(fs, root, url, 300, log)
    frozen = cluster.bed.power_off(victim)
    assert frozen, f"nothing ran in {victim}"
    off_at = time.time()
    try:
        wait_for(lambda: _lost_events(cluster, job, victim), 120, f"{victim} declared lost", interval=0.1,
                 diag=cluster.diag)
    finally:
        cluster.bed.power_on(victim, frozen)              # back at once: inside its old lease
    log.info("back_in_lease", victim=victim, back_after_s=round(time.time() - off_at, 2))
    wait_for(lambda: cluster.kinds(job, "node_rejoined"), 180, f"{victim} rejoined", diag=cluster.diag)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url, steps)
    lost = _lost_events(cluster, job, victim)
    assert len(lost) == 1 and lost[0]["detail"]["cause"] == "host_silent", cluster.events(job)
    fenced = [e for e in cluster.kinds(job, "host_fenced") if e["node"] == victim]
    assert len(fenced) == 1, cluster.events(job)
    reason = fenced[0]["detail"]["reason"]
    assert "revoked" in reason or "declared this node lost" in reason, fenced
    replaced_at = lost[0]["at"]
    grown_from = max(r["step"] for r in _restored(cluster, job))     # the last restore: the grown world's
    for step in store.steps():
        committed_at = fs.info(f"{root}/{step_dir_name(step)}/manifest.json")["LastModified"].timestamp()
        world = store.manifest(step)["world"]["world_size"]
        # no commit of the replaced world (4 ranks) after it was declared lost (S3 keeps whole seconds):
        # a 4-rank commit after that is the grown world's, past the step it restored
        assert committed_at < replaced_at + 1 or world == 2 or step > grown_from, (step, world, committed_at,
                                                                                  replaced_at, grown_from)
    assert sorted(cluster.losses(job)) == list(range(1, steps + 1))


# -- (g) a switch drops one host's data traffic, both links keep their carrier ------------------------
@pytest.mark.slow
def test_data_traffic_dropped_with_carriers_up(bed_cluster):
    """Neither host can tell which side failed (each reaches nobody, both links look fine). A world of one
    host needs no data network: the first by name keeps the job, even when it is the one whose traffic is
    dropped, and the other is cut off, fenced, and rejoins once the traffic flows again; no hang_timeout."""
    cluster = bed_cluster
    steps = 100
    job, url = _submit(cluster, "drop", "1:2", steps)
    _training_on_all(cluster, job, EVERY + 2)
    dropped, cut = "host1", "host2"
    cluster.bed.drop(dropped, "data")
    at = cluster.step(job)
    try:
        wait_for(lambda: cluster.kinds(job, "node_lost") or cluster.kinds(job, "hang_detected"), 300,
                 "a decision on the silent data network", interval=0.5, diag=cluster.diag)
        wait_for(lambda: cluster.world_size(job) == 2 and cluster.step(job) > at, 300,
                 f"{dropped} training alone", interval=0.2, diag=cluster.diag)
    finally:
        cluster.bed.restore(dropped, "data")
    wait_for(lambda: cluster.kinds(job, "node_rejoined"), 180, f"{cut} rejoined", diag=cluster.diag)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps)
    events = cluster.events(job)
    lost = cluster.kinds(job, "node_lost")
    assert len(lost) == 1 and lost[0]["detail"]["node"] == cut, events
    assert lost[0]["detail"]["cause"] == "data_network_gone" and lost[0]["detail"]["link_up"] is True, lost
    assert [e["node"] for e in cluster.kinds(job, "host_fenced")] == [cut], events
    assert [e["node"] for e in cluster.kinds(job, "node_rejoined")] == [cut], events
    assert not cluster.kinds(job, "hang_detected"), events
    assert sorted(cluster.losses(job)) == list(range(1, steps + 1))

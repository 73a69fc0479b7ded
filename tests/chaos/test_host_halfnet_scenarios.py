"""Chaos scenarios on the multi-host bed: networks that half work, seen from a live job.

Built like test_host_scenarios.py (its ``BedCluster`` and helpers): each bed host runs a real
``marind agent`` with the real trainer (2 ranks) on the bed's S3. The faults are nftables
filters in the hosts' namespaces (``HostBed.drop_one_way``, ``lossy``: the link stays up and
only some packets vanish) or one whole network of a host (``HostBed.drop``, carrier kept). What
marind does about each, and why, is docs/design.md §12's table "What marind does when links half work"; each
scenario asserts that outcome, that the job SUCCEEDED, that training stepped again within
``COARSE_S`` of the fault (from the fault to the first step of the world the outcome names, as
global rank 0's progress record in etcd shows it; the floor, ``RECOVERY_S``, is a logged figure), and that every committed checkpoint verifies and the job's
history holds every invariant (``_check_checkpoints``: 0 violations).

Every scenario here is ``slow`` (``make chaos``): CI's time goes to the bed's power-off scenario
(``test_host_scenarios``), and CI meets nftables in ``tests/hosts/test_filters_on_bed.py`` and the
agent's rules for a half-working link in their unit tests (``tests/agent/test_data_decisions.py``,
``tests/agent/liveness``). The
filter scenarios skip where ``nft`` is missing, saying so.
"""

from __future__ import annotations

import time

import pytest

from marind.core.log import get_logger
from tests.agent.helpers import wait_for
from tests.chaos.test_host_scenarios import (  # noqa: F401 - fixtures
    ETCD_GRACE,
    LEASE_TTL,
    BedCluster,
    _submit,
    _training_on_all,
    bed_cluster,
    dataset,
    hostbed,
)
from tests.chaos.test_scenarios import _check_checkpoints
from tests.hosts.conftest import require_nft

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(1500)]

log = get_logger("tests.host_halfnet")
#: from a fault to training again, issue 30's floor: a lease TTL (the longest wait of a loss decision) and
#: 10 s. A figure (logged as ``halfnet_steps_again``, and the faults table's "training again" column), not asserted:
#: a shared 2-core machine stretches it. The tests assert only the coarse bound below.
RECOVERY_S = LEASE_TTL + 10
#: training again within this, or something is wrong beyond a slow machine
COARSE_S = 120
THREE = pytest.param(("host1", "host2", "host3"), id="3hosts")


@pytest.fixture
def nft():
    """Skip, with the reason, where the bed's filters cannot be used (before the bed is built)."""
    require_nft()


def _training_past_a_commit(cluster: BedCluster, job: str, url: str, every: int) -> None:
    """Training on every host, with checkpoint ``every`` committed (a fault then costs at most the steps
    since it, not the whole run)."""
    _training_on_all(cluster, job, every + 2)
    wait_for(lambda: every in cluster.store(url).steps(), 600, f"checkpoint {every} committed", interval=0.5,
             diag=cluster.diag)


def _steps_again(cluster: BedCluster, job: str, fault_at: float, at: int, world: int, what: str) -> float:
    """Seconds from the fault until the job, on ``world`` ranks, makes a step: global rank 0's progress
    record names that world and its step moves (a world that restarted from an older checkpoint counts
    from its first step, not from when it is back past ``at``, the step at the fault, which is logged)."""
    return _world_steps(cluster, job, fault_at, at, world, what)[0]


def _world_steps(cluster: BedCluster, job: str, fault_at: float, at: int, world: int,
                 what: str) -> tuple[float, float]:
    """(seconds from the fault, seconds from the last step of any other world) until the job makes a step
    on ``world`` ranks (``_steps_again``; the second is the pause the fault cost training, to the progress
    records' interval)."""
    seen: list[int] = []
    other = {"step": None, "at": fault_at}

    def stepped() -> bool:
        progress = cluster.client.get_json(cluster.client.key("jobs", job, "progress")) or {}
        step = int(progress.get("step") or 0)
        if int(progress.get("world_size") or 0) != world:
            seen.clear()
            if step != other["step"]:
                other.update(step=step, at=time.time())
            return False
        seen.append(step)
        return seen[-1] > min(seen)      # a step up (a restore to an older step is none)

    wait_for(stepped, 300, f"{job} stepping on {world} ranks ({what})", interval=0.1, diag=cluster.diag)
    took, paused = time.time() - fault_at, time.time() - float(other["at"] or fault_at)
    wait_for(lambda: cluster.step(job) > at, 300, f"{job} past step {at}", interval=0.2, diag=cluster.diag)
    log.info("halfnet_steps_again", job=job, fault=what, after_s=round(took, 1), paused_s=round(paused, 1),
             at_step=at, step=seen[-1], world=world, past_fault_step_after_s=round(time.time() - fault_at, 1))
    return took, paused


def _timeline(cluster: BedCluster, job: str, fault_at: float) -> list[tuple[float, str, str]]:
    """The job's events as (seconds after the fault, kind, node), logged for the report."""
    rows = [(round(e["at"] - fault_at, 1), e["kind"], e.get("node", "")) for e in cluster.events(job)]
    log.info("halfnet_events", job=job, events=rows)
    return rows


def _finish(cluster: BedCluster, job: str, url: str, steps: int, again_s: float | None = None) -> list[dict]:
    """The job succeeded with its history intact (``again_s``: the faults table's "training again")."""
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps, again_s=again_s)
    assert sorted(cluster.losses(job)) == list(range(1, steps + 1))
    return cluster.events(job)


def _assert_cut_off_and_back(cluster: BedCluster, job: str, cut: str) -> None:
    """``cut`` was judged cut off (``data_network_gone``, its carrier up), fenced once, back once; no hang."""
    events = cluster.events(job)
    lost = cluster.kinds(job, "node_lost")
    assert len(lost) == 1 and lost[0]["detail"]["node"] == cut, events
    assert lost[0]["detail"]["cause"] == "data_network_gone" and lost[0]["detail"]["link_up"] is True, lost
    assert [e["node"] for e in cluster.kinds(job, "host_fenced")] == [cut], events
    assert [e["node"] for e in cluster.kinds(job, "node_rejoined")] == [cut], events
    assert not cluster.kinds(job, "hang_detected"), events


def _rejoins_and_finishes(cluster: BedCluster, job: str, url: str, steps: int, fault_at: float, took: float,
                          on_rejoin=None) -> None:
    """After the heal: host2 rejoins (then ``on_rejoin()``), the job finishes with its history intact, host2
    was the one cut off and back, and training stepped again within the coarse bound."""
    wait_for(lambda: cluster.kinds(job, "node_rejoined"), 180, "host2 rejoined", diag=cluster.diag)
    if on_rejoin is not None:
        on_rejoin()
    _finish(cluster, job, url, steps, again_s=took)
    _timeline(cluster, job, fault_at)
    _assert_cut_off_and_back(cluster, job, "host2")
    assert took <= COARSE_S, f"training stepped again {took:.1f}s after the fault (floor {RECOVERY_S}s)"


# -- (a) one host's packets to another vanish, the other's arrive: two hosts --------------------------

@pytest.mark.parametrize("src,dst", [pytest.param("host1", "host2", id="host1-to-host2",
                                                  marks=pytest.mark.slow),
                                     pytest.param("host2", "host1", id="host2-to-host1", marks=pytest.mark.slow)])
def test_one_way_data_drop_between_two_hosts(nft, bed_cluster, src, dst):  # noqa: F811 - the fixture
    """TCP needs both directions: each host's probes of the other fail, both links keep their carrier, so
    no side can tell which one failed. The first by name (host1) keeps the job whichever way the packets
    vanish; host2 is cut off, fenced, holds the job, and rejoins once its probes are answered (the heal)."""
    cluster = bed_cluster
    steps, every = 240, 60
    job, url = _submit(cluster, "one-way", "1:2", steps, every=every)
    _training_past_a_commit(cluster, job, url, every)
    at, fault_at = cluster.step(job), time.time()
    cluster.bed.drop_one_way(src, dst, "data")
    try:
        took = _steps_again(cluster, job, fault_at, at, 2, f"one-way {src}->{dst}")
    finally:
        cluster.bed.heal()
    _rejoins_and_finishes(cluster, job, url, steps, fault_at, took)


# -- (b) one-way among three hosts: the two hosts lose each other, both still reach the third ---------

@pytest.mark.slow
@pytest.mark.parametrize("hostbed", [THREE], indirect=True)
def test_one_way_data_drop_among_three_hosts(nft, bed_cluster):  # noqa: F811 - the fixture
    """host1's packets to host2 vanish. Every host still reaches a peer, but host1 and host2 cannot form the
    full mesh the workers' collectives need: one of the two (host2, the later by name) is cut off and the
    job goes on with host1 and host3; host2 holds the job until host1 answers it again."""
    cluster = bed_cluster
    steps, every = 400, 100
    job, url = _submit(cluster, "one-way-3", "1:3", steps, every=every)
    _training_past_a_commit(cluster, job, url, every)
    at, fault_at = cluster.step(job), time.time()
    cluster.bed.drop_one_way("host1", "host2", "data")
    try:
        took = _steps_again(cluster, job, fault_at, at, 4, "one-way host1->host2 among 3")
        time.sleep(10)      # host2 stays held while host1 does not answer it (host3 does)
        assert not cluster.kinds(job, "node_rejoined"), cluster.events(job)
    finally:
        cluster.bed.heal()
    _rejoins_and_finishes(cluster, job, url, steps, fault_at, took)


# -- (b2) one-way on the control network between two hosts: nothing marind uses crosses it ----------

@pytest.mark.slow
def test_one_way_control_drop_between_two_hosts_changes_nothing(nft, bed_cluster):  # noqa: F811 - the fixture
    """The hosts reach etcd and S3 on the bridge side, never each other, over the control network: the
    same world trains on through a one-way drop between them, no loss, no restart, no fence."""
    cluster = bed_cluster
    steps, every = 240, 60
    job, url = _submit(cluster, "one-way-ctl", "1:2", steps, every=every)
    _training_past_a_commit(cluster, job, url, every)
    at, fault_at = cluster.step(job), time.time()
    cluster.bed.drop_one_way("host1", "host2", "control")
    try:
        took = _steps_again(cluster, job, fault_at, at, 4, "one-way host1->host2 on the control network")
        time.sleep(max(0.0, LEASE_TTL + 5 - (time.time() - fault_at)))     # past a lease TTL: nothing lapses
    finally:
        cluster.bed.heal()
    _finish(cluster, job, url, steps, again_s=took)
    events = _timeline(cluster, job, fault_at)
    assert took <= COARSE_S, f"training stepped again {took:.1f}s after the fault (floor {RECOVERY_S}s)"
    assert cluster.restarts_per_node(job) == {n: 0 for n in cluster.nodes}, events
    assert not [e for e in events if e[1] in ("node_lost", "host_fenced", "hang_detected")], events


# -- (c) a quarter of one host's data packets lost, both ways -----------------------------------------

@pytest.mark.slow
def test_lossy_data_link_is_cut_off_until_it_is_steady(nft, bed_cluster):  # noqa: F811 - the fixture
    """25 % loss both ways: TCP gets bytes through (retransmitting), but the collectives, a long chain of
    small exchanges each waiting out its retransmission timeouts, all but stop. The probes fail and answer by
    turns, so neither host answers the other steadily: no side can tell which link is lossy, and host1 (first
    by name) keeps the job alone (a world of one host needs no data network); host2 is cut off and held until
    host1 answers every probe for a lease TTL, which a lossy link does not: it rejoins only after the heal."""
    cluster = bed_cluster
    steps, every, lossy_s = 400, 100, 30
    job, url = _submit(cluster, "lossy", "1:2", steps, every=every)
    _training_past_a_commit(cluster, job, url, every)
    at, fault_at = cluster.step(job), time.time()
    cluster.bed.lossy("host2", "data", 25)
    try:
        took = _steps_again(cluster, job, fault_at, at, 2, "25% loss on host2's data link")
        time.sleep(max(0.0, lossy_s - (time.time() - fault_at)))
        assert not cluster.kinds(job, "node_rejoined"), cluster.events(job)      # not back while lossy
    finally:
        cluster.bed.heal()
    healed_at = time.time()
    _rejoins_and_finishes(cluster, job, url, steps, fault_at, took,
                          on_rejoin=lambda: log.info("halfnet_lossy_rejoined",
                                                     after_heal_s=round(time.time() - healed_at, 1)))


# -- (d) the control network of one host gone past etcd_grace_timeout, its data network working -------

@pytest.mark.slow
def test_control_network_gone_past_the_grace(bed_cluster):  # noqa: F811 - the fixture
    """Its lease expires but its workers step on (nobody restarts a world that trains); once torchrun's
    rendezvous has failed to reach etcd for ``etcd_grace_timeout`` it gives up and takes its workers with it,
    the other host's workers stall, and that host restarts without it (``node_lost``, its lease expired).
    The cut host fences itself (lease lapsed, workers stopped) and, once etcd answers, rejoins."""
    cluster = bed_cluster
    steps, every = 800, 100
    job, url = _submit(cluster, "ctl-gone", "1:2", steps, every=every)
    _training_past_a_commit(cluster, job, url, every)
    victim = cluster.host_of_rank(job, 2)
    at, fault_at = cluster.step(job), time.time()
    cluster.bed.drop(victim, "control")
    try:
        time.sleep(LEASE_TTL + 5)
        assert cluster.world_size(job) == 4 and cluster.step(job) > at + 3, "the world trained on past its lease"
        assert not cluster.kinds(job, "node_lost"), cluster.events(job)
        took, paused = _world_steps(cluster, job, fault_at, at, 2, f"{victim}'s control network gone")
    finally:
        cluster.bed.restore(victim, "control")
    wait_for(lambda: cluster.kinds(job, "node_rejoined"), 180, f"{victim} rejoined", diag=cluster.diag)
    _finish(cluster, job, url, steps, again_s=paused)     # it trained on through the lease: the pause is the cost
    events = _timeline(cluster, job, fault_at)
    lost = cluster.kinds(job, "node_lost")
    assert [(e["detail"]["node"], e["detail"]["cause"]) for e in lost] == [(victim, "lease_expired")], events
    assert [e["node"] for e in cluster.kinds(job, "host_fenced")] == [victim], events
    assert [e["node"] for e in cluster.kinds(job, "node_rejoined")] == [victim], events
    assert not cluster.kinds(job, "hang_detected"), events
    # the world breaks only when the cut host's torchrun gives up (the grace, from its first failed call):
    # from there, not from the cut, training pauses for at most RECOVERY_S
    assert paused <= COARSE_S, f"training paused {paused:.1f}s ({took:.1f}s after the cut; floor {RECOVERY_S}s)"

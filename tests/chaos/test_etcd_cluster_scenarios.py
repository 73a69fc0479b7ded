"""Chaos scenarios with etcd as a real 3-member cluster: 2 agents x 2 ranks of the real trainer.

Production etcd is a cluster whose leader moves and whose members go down; here every agent,
torchrun and CLI call is given all three endpoints, and the faults are the cluster's: one
member down before the job starts, the leader SIGKILLed while the job trains, during its first
rendezvous round and during a checkpoint commit, a member stopped and started again with its
data, and two members lost together (no quorum) for 20 s. Each scenario asserts: the job
SUCCEEDED with its configured step count, no ``node_lost`` (no node was lost: only etcd
members), at most one restart, every committed checkpoint verifies, and the final state is
bit-identical to a fault-free run. CI runs the member-down and leader-kill scenarios; the
rest is ``@pytest.mark.slow`` (``make chaos``).
"""

from __future__ import annotations

import time

import pytest

from marind.cli import main as marind_main
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_cluster import EtcdCluster
from tests.agent.helpers import wait_for
from tests.chaos.test_scenarios import (
    EVERY,
    Cluster,
    _check_checkpoints,
    dataset,  # noqa: F401 - the fixture
    fault_free_final_state,
    final_tensor_objects,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd-cluster")) as cluster:
        yield cluster


@pytest.fixture
def members(etcd3):
    """The cluster, every member running again and a leader elected after the test."""
    yield etcd3
    etcd3.restore()


@pytest.fixture
def on_cluster(request, tmp_path, members, s3, dataset, capsys, monkeypatch):  # noqa: F811
    prefix = f"/marind-etcd3-{request.node.name[-40:]}-{int(time.time() * 1000) % 10**8}"
    client = EtcdClient(members.endpoints, prefix=prefix)
    try:
        yield Cluster(tmp_path, members, client, prefix, s3, dataset, capsys, monkeypatch)
    finally:
        try:
            client.delete_prefix(prefix)
        finally:
            client.close()


def _no_node_lost_and_at_most_one_restart(cluster: Cluster, job: str) -> dict:
    events = cluster.events(job)
    lost = [e for e in events if e["kind"] in ("node_lost", "node_fenced")]
    assert not lost, f"an etcd member went, not a node: {lost}"
    per_node = cluster.restarts_per_node(job)
    assert max(per_node.values(), default=0) <= 1, per_node
    return per_node


def _finish(cluster: Cluster, job: str, url: str, baseline: dict) -> None:
    state = cluster.wait_done(job, timeout=400)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline, \
        "etcd's faults must not change what the job computes"
    _no_node_lost_and_at_most_one_restart(cluster, job)


@pytest.mark.parametrize("down", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["first-listed", "last-listed"])
def test_one_member_down_every_cli_command_works_and_the_job_succeeds(on_cluster, members, down, capsys):
    baseline = fault_free_final_state(on_cluster)
    members.stop_member(down)
    members.wait_for_leader()
    for argv in (["status"], ["nodes"], ["status", "--json"]):
        for _ in range(5):                        # each a fresh client drawing its first member
            assert marind_main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    job, url = on_cluster.submit("member-down")
    for argv in (["status", job], ["events", job]):
        assert marind_main(argv) == 0, capsys.readouterr().err
    _finish(on_cluster, job, url, baseline)


def _kill_leader_when(cluster: Cluster, members: EtcdCluster, name: str, moment, what: str) -> None:
    """Submit a job, SIGKILL etcd's leader once ``moment(job, url)`` holds, and check the end."""
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit(name)
    wait_for(lambda: moment(job, url), 240, what, interval=0.05, diag=cluster.diag)
    killed = members.kill_leader()
    members.wait_for_leader(other_than=killed)
    _finish(cluster, job, url, baseline)


def test_leader_killed_while_training(on_cluster, members):
    _kill_leader_when(on_cluster, members, "leader-training", lambda job, url: on_cluster.step(job) >= EVERY + 2,
                      "training")


@pytest.mark.slow
def test_leader_killed_during_the_first_rendezvous_round(on_cluster, members):
    client = on_cluster.client
    _kill_leader_when(on_cluster, members, "leader-rdzv",
                      lambda job, url: client.get_prefix_keys(client.key("jobs", job, "rdzv") + "/"),
                      "the rendezvous begun")


@pytest.mark.slow
def test_leader_killed_during_a_checkpoint_commit(on_cluster, members):
    """Killed as the second save begins (its commit follows within the save's second or two)."""
    _kill_leader_when(on_cluster, members, "leader-commit",
                      lambda job, url: on_cluster.step(job) >= 2 * EVERY and len(on_cluster.store(url).steps()) >= 1,
                      "the second save begun")


@pytest.mark.slow
def test_member_stopped_and_started_again_with_its_data(on_cluster, members):
    baseline = fault_free_final_state(on_cluster)
    job, url = on_cluster.submit("member-maintenance")
    wait_for(lambda: on_cluster.step(job) >= EVERY + 2, 240, "training", interval=0.2, diag=on_cluster.diag)
    leader = members.wait_for_leader()
    down = (leader + 1) % len(members.members)
    members.stop_member(down)
    time.sleep(5)
    members.start_member(down)
    _finish(on_cluster, job, url, baseline)


@pytest.mark.slow
def test_two_members_lost_for_20s_and_back(on_cluster, members):
    """No quorum for 20 s: etcd serves nothing; nodes keep their leases (etcd does not expire a
    lease without a leader, and a new leader renews them all) and the job trains on."""
    baseline = fault_free_final_state(on_cluster)
    job, url = on_cluster.submit("no-quorum")
    wait_for(lambda: on_cluster.step(job) >= EVERY + 2, 240, "training", interval=0.2, diag=on_cluster.diag)
    leader = members.wait_for_leader()
    lost = [(leader + 1) % 3, (leader + 2) % 3]
    for i in lost:
        members.kill(i)
    time.sleep(20)
    for i in lost:
        members.start_member(i)
    members.wait_for_leader()
    _finish(on_cluster, job, url, baseline)

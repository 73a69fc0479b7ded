"""etcd as a 3-member cluster on the multi-host bed: a job on 2 hosts over the data network while
the cluster loses its leader, then a member for maintenance.

The bed's etcd members run beside its S3 on the control network (``HostBed(etcd_members=3)``);
every agent and torchrun is given all three endpoints. Expected, as in
tests/chaos/test_etcd_cluster_scenarios.py: SUCCEEDED, no node lost, at most one restart, and
the history checker's invariants (through ``_check_checkpoints``).
"""

from __future__ import annotations

import time

import pytest

from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_cluster import EtcdCluster
from marind.testing.hosts import HostBed
from tests.agent.helpers import wait_for
from tests.chaos.test_host_scenarios import BedCluster, _submit, _training_on_all, dataset  # noqa: F401
from tests.chaos.test_scenarios import _check_checkpoints
from tests.hosts.conftest import built_bed, require_bed

pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture
def bed3(tmp_path):
    require_bed()
    yield from built_bed(tmp_path, ["host1", "host2"], s3=True, etcd_members=3)


def test_leader_killed_then_a_member_stopped_on_the_bed(bed3: HostBed, etcd_prefix, dataset, capsys,  # noqa: F811
                                                       monkeypatch):
    members = bed3.etcd
    assert isinstance(members, EtcdCluster)
    assert len(bed3.plan.etcd.split(",")) == 3
    with EtcdClient(bed3.plan.etcd, prefix=etcd_prefix) as client:
        cluster = BedCluster(bed3, client, etcd_prefix, dataset, capsys, monkeypatch)
        steps, every = 120, 30          # the faults fall inside the run, with a save between them
        job, url = _submit(cluster, "bed-etcd3", "2", steps, every=every)
        _training_on_all(cluster, job, every + 2)
        killed = members.kill_leader()
        members.wait_for_leader(other_than=killed)
        members.start_member(killed)
        wait_for(lambda: cluster.step(job) >= 2 * every + 2, 600, "training past the next save", interval=0.2,
                 diag=cluster.diag)
        down = (members.wait_for_leader() + 1) % 3
        members.stop_member(down)
        time.sleep(5)
        members.start_member(down)
        state = cluster.wait_done(job, timeout=900)
        assert state["state"] == "SUCCEEDED", state
        events = cluster.events(job)
        assert not [e for e in events if e["kind"] in ("node_lost", "host_fenced")], events
        assert max(cluster.restarts_per_node(job).values(), default=0) <= 1
        _check_checkpoints(cluster, url, steps)

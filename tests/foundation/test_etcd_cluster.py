"""The etcd client against a real 3-member etcd cluster: one member down fails no call, a
killed leader fails no call, a retried write that had landed is reported as ours, and the
members' status names the leader.
"""

from __future__ import annotations

import threading
import time

import pytest

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.etcd_members import cluster_status, leader_endpoint
from marind.testing.etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd3")) as c:
        yield c


@pytest.fixture
def all_up(cluster):
    """Every member running again after the test, and a leader."""
    yield cluster
    cluster.restore()


def _round_trip(endpoints: str, i: int) -> None:
    client = EtcdClient(endpoints, prefix="/cluster-test")
    try:
        client.ping()
        assert client.create(client.key(f"k{i}"), f"v{i}")
        assert client.get(client.key(f"k{i}"))[0] == f"v{i}".encode()
        ok, rev = client.compare_and_swap(client.key(f"k{i}"), f"w{i}", client.get(client.key(f"k{i}"))[1])
        assert ok and rev > 0
        lease = client.lease(5)
        assert client.refresh_lease(lease) > 0
        client.revoke_lease(lease)
        assert client.delete(client.key(f"k{i}"))
    finally:
        client.close()


@pytest.mark.parametrize("down", [0, 1, 2])
def test_one_member_down_fails_no_call(all_up, down):
    """The client draws its first member at random: 20 fresh clients meet the stopped one
    about 7 times (the old client failed those calls)."""
    all_up.stop_member(down)
    all_up.wait_for_leader()
    for i in range(20):
        _round_trip(all_up.endpoints, i)


def test_members_status_names_the_leader_and_the_member_down(all_up):
    leader = all_up.wait_for_leader()
    statuses = cluster_status(all_up.endpoints)
    assert [s.healthy for s in statuses] == [True, True, True]
    assert leader_endpoint(statuses) == all_up.members[leader].endpoint
    assert sum(s.is_leader for s in statuses) == 1
    down = (leader + 1) % 3
    all_up.stop_member(down)
    statuses = cluster_status(all_up.endpoints)
    assert not statuses[down].healthy and statuses[down].error
    assert leader_endpoint(statuses) == all_up.members[leader].endpoint


def test_leader_killed_while_a_client_writes_fails_no_call(all_up):
    client = EtcdClient(all_up.endpoints, prefix="/cluster-test")
    errors: list[str] = []
    done = threading.Event()
    writes = [0]

    def writer():
        while not done.is_set():
            try:
                client.put(client.key("busy"), str(writes[0]))
                client.get(client.key("busy"))
                writes[0] += 1
            except ControlPlaneUnavailable as exc:
                errors.append(str(exc))
            time.sleep(0.01)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.5)
        killed = all_up.kill_leader()
        all_up.wait_for_leader(other_than=killed)
        time.sleep(1.0)
    finally:
        done.set()
        thread.join(30)
        client.close()
    assert errors == []
    assert writes[0] > 20


def test_no_quorum_is_an_outage_and_quorum_back_is_served(all_up):
    all_up.stop_member(1)
    all_up.stop_member(2)
    client = EtcdClient(all_up.endpoints, prefix="/cluster-test", timeout=1.0)
    try:
        with pytest.raises(ControlPlaneUnavailable):
            client.put(client.key("q"), "1")
        all_up.start_member(1)
        all_up.wait_for_leader()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.put(client.key("q"), "2")
                break
            except ControlPlaneUnavailable:
                assert time.monotonic() < deadline, "quorum back, but the client was not served"
                time.sleep(0.2)
        assert client.get(client.key("q"))[0] == b"2"
    finally:
        client.close()


def test_a_retried_create_that_had_landed_is_ours(cluster):
    """The first member takes the create and the answer is lost: sent again to the next
    member, the key is there holding our value and lease, so the create is ours."""
    client = EtcdClient(cluster.endpoints, prefix="/cluster-test")
    try:
        key = client.key("landed")
        client.delete(key)
        lease = client.lease(10)
        inner = client._client.put_if_not_exists
        calls = [0]

        def lost_answer(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                inner(*args, **kwargs)          # applied...
                from etcd3 import exceptions as etcd_exc
                raise etcd_exc.ConnectionFailedError()   # ...but the answer never came
            return inner(*args, **kwargs)

        client._client.put_if_not_exists = lost_answer
        assert client.create(key, "mine", lease=lease) is True
        assert calls[0] == 2
        client._client.put_if_not_exists = inner
        other = client.lease(10)
        assert client.create(key, "mine", lease=other) is False      # not retried: an honest no
        client.revoke_lease(lease)
        client.revoke_lease(other)
    finally:
        client.close()


def test_doctor_reports_every_member_the_leader_and_a_member_down(all_up, monkeypatch):
    from marind.commands.doctor import check_etcd_members
    monkeypatch.delenv("MARIND_CONFIG", raising=False)
    checks = check_etcd_members(all_up.endpoints, None)
    assert [c.ok for c in checks] == [True, True, True] and not any(c.warn for c in checks)
    assert sum(c.detail.startswith("leader,") for c in checks) == 1
    leader = all_up.wait_for_leader()
    down = (leader + 1) % 3
    all_up.stop_member(down)
    checks = check_etcd_members(all_up.endpoints, None)
    assert checks[down].ok and checks[down].warn and "quorum holds" in checks[down].detail
    assert checks[leader].detail.startswith("leader,")
    all_up.stop_member((leader + 2) % 3)
    checks = check_etcd_members(all_up.endpoints, None)
    assert not checks[down].ok and "no quorum" in checks[down].fix

"""The data network's rows (``marind.agent.liveness.reach_rows``) on a real etcd: put only when they
change, read once and then from a watch, gone with their node's lease; counted, not timed.

The rows rode in the node records before, which reached the other nodes only with a full read
of every record every 30 s (O(N²) bytes per 30 s across a job, and stale for 20 of those 30 s).
"""

from __future__ import annotations

import pytest

from marind.agent.liveness.reach_rows import ReachRows, row_changed
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_metrics import etcd_counters
from tests.agent.helpers import wait_for

PEERS = 30


def _row(down: dict | None = None, at: float = 1.0) -> dict:
    return {"addr": "10.0.0.1", "port": 4000, "token": "t", "link_up": True, "at": at,
            "probed": ["b", "c"], "down": down or {}}


@pytest.mark.unit
def test_a_row_changes_when_anything_but_its_time_does():
    assert row_changed(_row(), None)
    assert not row_changed(_row(at=5.0), _row(at=1.0))
    assert row_changed(_row({"b": 3.0}), _row())
    assert row_changed({**_row(), "link_up": False}, _row())


def test_rows_are_put_on_change_and_kept_fresh_by_a_watch(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/reach")
    ep = etcd_private.endpoint
    lease_a, lease_peers = client.lease(60), client.lease(60)
    a = ReachRows(client, "j", "a")
    b = ReachRows(client, "j", "b")
    peers = [ReachRows(client, "j", f"p{i:02d}") for i in range(PEERS)]
    try:
        for p in peers:
            assert p.publish({**_row(), "padding": "x" * 100}, lease_peers)
        assert a.publish(_row(), lease_a) and not a.publish(_row(at=9.0), lease_a)   # only its time moved
        first = etcd_counters(ep)
        assert set(b.refresh()) == {"a", *(f"p{i:02d}" for i in range(PEERS))}
        read = etcd_counters(ep)

        assert a.publish(_row({"b": 2.0}, at=10.0), lease_a)      # a stopped hearing b: b sees it next
        wait_for(lambda: b.refresh()["a"]["down"] == {"b": 2.0}, 10, "a's changed row in b's view")
        for _ in range(5):                                         # nothing changes: no request at all
            before = etcd_counters(ep)
            b.refresh()
            assert etcd_counters(ep)["requests"] == before["requests"]
        changed = etcd_counters(ep)
        assert a.publish(_row({"b": 2.0, "c": 4.0}, at=11.0), lease_a)
        wait_for(lambda: "c" in b.refresh()["a"]["down"], 10, "a's second change")
        after = etcd_counters(ep)
        # a change costs its put and one watch event to each watcher, not every row again
        assert after["bytes_out"] - changed["bytes_out"] < (read["bytes_out"] - first["bytes_out"]) / 4

        client.revoke_lease(lease_a)                              # a is away: its row goes with its lease
        wait_for(lambda: "a" not in b.refresh(), 10, "a's row gone with its lease")

        b._watch(None)                                            # the watch's stream ended ...
        peers[0].close()                                          # ... and p00 dropped its row meanwhile
        assert "p00" not in b.refresh()                           # a new watch and a read of every row
        assert len(b.rows) == PEERS - 1
    finally:
        for r in (a, b, *peers):
            r.close(drop=False)
        client.close()


def test_a_new_lease_puts_the_row_again(etcd_private):
    """A node registered anew (a fence: a new lease) puts its row again though it did not change."""
    client = EtcdClient(etcd_private.endpoint, prefix="/reach2")
    rows = ReachRows(client, "j", "a")
    try:
        first = client.lease(60)
        assert rows.publish(_row(), first) and not rows.publish(_row(), first)
        client.revoke_lease(first)
        assert client.get(rows.prefix + "a")[0] is None
        second = client.lease(60)
        assert rows.publish(_row(), second)
        assert client.lease_of(rows.prefix + "a") == second.id
    finally:
        rows.close()
        client.close()


def test_a_row_of_a_node_not_in_the_job_has_no_say(etcd_private):
    """A row that outlived its node's part in the job (its delete failed, the lease lives on for
    another job) names no endpoint to probe: only nodes with a record in the job count."""
    from types import SimpleNamespace

    from marind.agent.liveness.data_watch import DataWatch
    from marind.agent.membership import Membership, report_record

    client = EtcdClient(etcd_private.endpoint, prefix="/reach3")
    lease = client.lease(60)
    members = Membership(client, "j", "a", "1")
    rows = ReachRows(client, "j", "a")
    try:
        for node in ("b", "gone"):
            ReachRows(client, "j", node).publish({**_row(), "addr": f"10.0.0.{len(node)}"}, lease)
        report_record(client, "j", "b", {"node": "b", "agent_pid": 2}, lease, None)
        report_record(client, "j", "a", {"node": "a", "agent_pid": 1}, lease, members)
        members.poll()
        rows.refresh()
        run = SimpleNamespace(members=members, node="a", job="j")
        watch = DataWatch(run, prober=None, reach=rows)           # type: ignore[arg-type]  # endpoints() only
        assert set(watch.endpoints()) == {"b"}
    finally:
        members.close()
        rows.close(drop=False)
        client.close()

"""node_lost is recorded once per lost node, by whichever agent notices first, never for a clean leave."""

from __future__ import annotations

import pytest

from marind.agent.membership import Membership, vanished


@pytest.mark.unit
def test_vanished_is_the_incarnations_gone_or_replaced_except_mine():
    assert vanished({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9"}, me="a") == [("b", "2"), ("c", "3")]
    assert vanished({"a": "1"}, {}, me="a") == []


def _record(client, job, node, pid):
    client.put_json(client.key("jobs", job, "nodes", node), {"node": node, "agent_pid": pid})


def test_a_lost_node_is_reported_once_and_a_clean_leave_never(etcd_client):
    job = "j1"
    a, b, c = (Membership(etcd_client, job, n, pid) for n, pid in (("a", 1), ("b", 2), ("c", 3)))
    for m in (a, b, c):
        _record(etcd_client, job, m.node, m.incarnation)
    assert a.poll() == [] and b.poll() == [] and c.poll() == []

    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "c"))       # c's lease expired
    assert a.poll() + b.poll() == ["c"], "exactly one survivor reports the loss"
    assert a.poll() == [] and b.poll() == []

    b.leaving("job done")                                                # b ends cleanly
    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "b"))
    assert a.poll() == []

    _record(etcd_client, job, "c", 30)                                   # c is back ...
    assert a.poll() == []
    _record(etcd_client, job, "c", 31)                                   # ... dies, and is back before its lease expired
    assert a.poll() == ["c"]

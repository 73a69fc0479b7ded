"""node_lost is recorded once per lost node, by whichever agent notices first, never for a clean leave."""

from __future__ import annotations

import pytest

from marind.agent.membership import (
    AGENT_RESTARTED,
    LEASE_EXPIRED,
    RECORD_DROPPED,
    Loss,
    Membership,
    report_record,
    vanished,
)
from marind.core.rdzv_keys import lost_prefix, members_key, rank_key, round_key
from marind.rendezvous.lost import LostNodes, publish_member, publish_round


@pytest.mark.unit
def test_vanished_is_the_incarnations_gone_or_replaced_except_mine():
    assert vanished({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9"}, me="a") == [("b", "2"), ("c", "3")]
    assert vanished({"a": "1"}, {}, me="a") == []


def _record(client, job, node, pid):
    client.put_json(client.key("jobs", job, "nodes", node), {"node": node, "agent_pid": pid})


def _lost(m):
    return [loss.node for loss in m.poll() if m.claim(loss, {})]


def test_a_lost_node_is_reported_once_and_a_clean_leave_never(etcd_client):
    job = "j1"
    a, b, c = (Membership(etcd_client, job, n, pid) for n, pid in (("a", 1), ("b", 2), ("c", 3)))
    for m in (a, b, c):
        _record(etcd_client, job, m.node, m.incarnation)
    assert _lost(a) == [] and _lost(b) == [] and _lost(c) == []

    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "c"))       # c's lease expired
    assert _lost(a) + _lost(b) == ["c"], "exactly one survivor reports the loss"
    assert _lost(a) == [] and _lost(b) == []

    b.leaving("job done")                                                # b ends cleanly
    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "b"))
    assert a.poll() == []

    _record(etcd_client, job, "c", 30)                                   # c is back ...
    assert _lost(a) == []
    _record(etcd_client, job, "c", 31)                                   # ... dies, and is back before its lease expired
    assert _lost(a) == ["c"]


def test_a_loss_carries_its_cause_and_last_record_and_a_record_back_is_no_loss(etcd_client):
    job = "j2"
    a = Membership(etcd_client, job, "a", 1)
    etcd_client.put_json(etcd_client.key("jobs", job, "nodes", "b"),
                         {"node": "b", "agent_pid": 2, "torchrun_pid": 20, "workers": [{"rank": 1}]})
    etcd_client.put_json(etcd_client.key("nodes", "b"), {"node": "b", "pid": 2})
    assert a.poll() == []
    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "b"))       # its job record went, the node stays
    [loss] = a.poll()
    assert (loss.node, loss.incarnation, loss.cause, loss.in_round) == ("b", "2", RECORD_DROPPED, True)
    assert loss.record["torchrun_pid"] == 20
    etcd_client.delete(etcd_client.key("nodes", "b"))
    _record(etcd_client, job, "b", 2)
    assert a.poll() == [] and a.present(loss)                            # back: not lost after all
    etcd_client.delete(etcd_client.key("jobs", job, "nodes", "b"))
    assert [x.cause for x in a.poll()] == [LEASE_EXPIRED]


def _report(client, m, record):
    report_record(client, m.job, m.node, record, None, m)
    return [(loss.node, loss.incarnation, loss.cause, loss.record.get("step")) for loss in m.poll()]


def test_a_report_learns_the_records_that_came_or_went_and_a_loss_carries_the_last_value(etcd_client):
    job = "j5"
    a = Membership(etcd_client, job, "a", 1)
    key = etcd_client.key("jobs", job, "nodes", "b")
    try:
        etcd_client.put_json(key, {"node": "b", "agent_pid": 2, "step": 1})
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == []
        assert a.known == {"a": "1", "b": "2"}
        etcd_client.put_json(key, {"node": "b", "agent_pid": 2, "step": 7})   # a steady report: a count
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == []
        etcd_client.delete(key)                                              # b's lease expired ...
        # ... its loss carries its last record (the watch's delete), not the one last read (step 1)
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == [("b", "2", LEASE_EXPIRED, 7)]
        etcd_client.put_json(key, {"node": "b", "agent_pid": 3, "step": 0})   # b's next incarnation came
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == [] and a.known["b"] == "3"
        etcd_client.put_json(key, {"node": "b", "agent_pid": 3, "step": 4})
        etcd_client.delete(key)                                              # gone and back between two reports
        etcd_client.put_json(key, {"node": "b", "agent_pid": 5, "step": 0})
        # (its last record where the delete's event came before the report, else the one last read)
        [loss] = _report(etcd_client, a, {"node": "a", "agent_pid": 1})
        assert loss[:3] == ("b", "3", AGENT_RESTARTED) and loss[3] in (0, 4), loss
        assert a.known == {"a": "1", "b": "5"}
    finally:
        a.close()


def test_mark_lost_names_the_lost_torchrun_for_the_rendezvous(etcd_client):
    job = "j3"
    a = Membership(etcd_client, job, "a", 1)
    loss = Loss("b", "2", LEASE_EXPIRED, {"torchrun_pid": 20, "workers": [{"rank": 1}]})
    assert a.rdzv_desc(loss) is None                                     # b's torchrun never published
    assert a.in_current_round(loss, None) is True                        # then: its record ran workers
    publish_member(etcd_client, job, "b", "hostb_20_0")
    etcd_client.put_json(members_key(etcd_client, job, "b"), {"desc": "hostb_20_0", "pid": 20})
    desc = a.rdzv_desc(loss)
    assert desc == "hostb_20_0"
    assert a.in_current_round(loss, desc) is True                        # no round published yet
    publish_round(etcd_client, job, 3, frozenset({"hosta_10_0"}))        # a round formed without it
    assert a.in_current_round(loss, desc) is False
    publish_round(etcd_client, job, 4, frozenset({"hosta_10_0", desc}))
    assert a.in_current_round(loss, desc) is True
    # the etcd3 handler's record names no participants: the lost torchrun's rank key of that round
    closed = {"round": 5, "world_size": 1, "at": 0.0, "by": "hosta_10_0"}
    etcd_client.put_json(round_key(etcd_client, job), closed)
    etcd_client.put_json(rank_key(etcd_client, job, 5, "hosta_10_0"), {"rank": 0, "by": "hosta_10_0"})
    assert a.in_current_round(loss, desc) is False
    etcd_client.put_json(rank_key(etcd_client, job, 5, desc), {"rank": 1, "by": "hosta_10_0"})
    assert a.in_current_round(loss, desc) is True
    a.mark_lost(loss, desc)
    marker = etcd_client.get_json(lost_prefix(etcd_client, job) + "hostb_20_0")
    assert marker["node"] == "b" and marker["cause"] == LEASE_EXPIRED and marker["by"] == "a"
    etcd_client.put_json(members_key(etcd_client, job, "b"), {"desc": "hostb_21_0", "pid": 21})
    assert a.rdzv_desc(loss) is None                                     # b runs a newer torchrun: not that one
    lost = LostNodes(etcd_client, job)
    try:
        assert lost.descs() == frozenset({"hostb_20_0"})
    finally:
        lost.close()


def test_a_node_learns_it_was_declared_lost_by_its_claim_or_its_rendezvous_marker(etcd_client):
    job = "j4"
    a = Membership(etcd_client, job, "a", 1)
    b = Membership(etcd_client, job, "b", 2)
    assert b.declared_lost(20) is False                                  # nothing published yet
    etcd_client.put_json(members_key(etcd_client, job, "b"), {"desc": "hostb_20_0", "pid": 20})
    assert b.declared_lost(20) is False
    loss = Loss("b", "2", LEASE_EXPIRED, {"torchrun_pid": 20, "workers": [{"rank": 0}]})
    a.mark_lost(loss, "hostb_20_0")
    assert b.declared_lost(20) is True                                   # its torchrun's descriptor is marked
    assert b.declared_lost(21) is False                                  # a later torchrun is not that one
    c = Membership(etcd_client, job, "c", 3)
    assert c.declared_lost(None) is False
    assert a.claim(Loss("c", "3", LEASE_EXPIRED, {}), {}) is True
    assert c.declared_lost(None) is True                                 # the departed claim names it
    assert Membership(etcd_client, job, "c", 4).declared_lost(None) is False   # its next incarnation is not


def test_a_new_incarnation_drops_the_record_an_earlier_one_left_and_nothing_else(etcd_client):
    """An agent registered anew (a fence: ``pid.2``) deletes its node's record of the earlier
    incarnation before its first put, so the others see that one go; a second run of the same
    incarnation deletes nothing (no loss)."""
    job = "j-inc"
    key = etcd_client.key("jobs", job, "nodes", "b")
    a = Membership(etcd_client, job, "a", 1)
    first = Membership(etcd_client, job, "b", 2)
    try:
        _report(etcd_client, first, {"node": "b", "agent_pid": 2})
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == [] and a.known["b"] == "2"
        again = Membership(etcd_client, job, "b", 2)                  # a second run, same incarnation
        _report(etcd_client, again, {"node": "b", "agent_pid": 2, "step": 3})
        again.close()
        assert _report(etcd_client, a, {"node": "a", "agent_pid": 1}) == []
        fenced = Membership(etcd_client, job, "b", "2.2")             # registered anew after a fence
        _, before = etcd_client.get(key)
        _report(etcd_client, fenced, {"node": "b", "agent_pid": 2, "incarnation": "2.2"})
        fenced.close()
        _, after = etcd_client.get(key)
        assert etcd_client.get_json(key)["incarnation"] == "2.2" and after > before
        [loss] = _report(etcd_client, a, {"node": "a", "agent_pid": 1})
        assert loss[:2] == ("b", "2"), loss                           # the earlier incarnation's loss, at once
    finally:
        first.close()
        a.close()

"""The per-round rendezvous (``marind.rendezvous.rounds``, ``closer``): its rules, and lost nodes on a real etcd."""

from __future__ import annotations

import json
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from marind.core.rdzv_keys import closer_key, join_prefix, lost_key, rank_key, round_key
from marind.rendezvous import create_etcd3_handler
from marind.rendezvous.closer import Closer
from marind.rendezvous.lost import LostNodes
from marind.rendezvous.rounds import Closed, Place, Rounds, choose, close_due, parse_desc, rank_order
from tests.agent.helpers import wait_for


# -- rules (pure) ---------------------------------------------------------------------------------------
@pytest.mark.unit
def test_rank_order_is_torchs_descriptor_order():
    assert parse_desc("my_host.example_123_4") == ("my_host.example", 123, 4)
    # torch sorts (addr, pid, local_id) as values: pid 9 before pid 10
    assert rank_order(["b_1_0", "a_10_0", "a_9_1", "a_9_0"]) == ["a_9_0", "a_9_1", "a_10_0", "b_1_0"]


@pytest.mark.unit
def test_choose_takes_the_first_joiners_up_to_max_without_the_lost():
    joined = [("c_1_0", 13), ("a_1_0", 12), ("b_1_0", 11), ("d_1_0", 10)]
    assert choose(joined, frozenset(), 3) == ["a_1_0", "b_1_0", "d_1_0"]     # by join order, then ranked
    assert choose(joined, frozenset({"d_1_0"}), 3) == ["a_1_0", "b_1_0", "c_1_0"]


@pytest.mark.unit
def test_close_due_follows_torchs_min_max_and_last_call():
    kw = dict(min_nodes=2, max_nodes=4, last_call=30.0)
    assert close_due(now=0, prev_live=1, joined=4, deadline=None, **kw) == (False, None)   # previous round not left
    assert close_due(now=0, prev_live=0, joined=1, deadline=5.0, **kw) == (False, None)    # below min: no deadline
    assert close_due(now=0, prev_live=0, joined=2, deadline=None, **kw) == (False, 30.0)   # the last call starts
    assert close_due(now=29, prev_live=0, joined=3, deadline=30.0, **kw) == (False, 30.0)
    assert close_due(now=30, prev_live=0, joined=3, deadline=30.0, **kw) == (True, 30.0)
    assert close_due(now=1, prev_live=0, joined=4, deadline=None, **kw)[0] is True          # max: at once


# -- the keys' guards on a real etcd -----------------------------------------------------------------------
def test_a_round_is_closed_once_and_nobody_joins_a_closed_round(etcd_client):
    rounds = Rounds(etcd_client, "guards", grace=5)
    lease = etcd_client.lease(30)
    assert rounds.join("a_1_0", lease.id, -1, Place(0), None)[0] is True
    assert rounds.close(0, ["a_1_0"], "a_1_0") is None                # not the closer: refused, nothing written
    assert rounds.members(0) == []
    assert rounds.claim_closer("a_1_0", 0, lease.id)
    closed = rounds.close(0, ["a_1_0"], "a_1_0")
    assert closed == Closed(0, 1, "a_1_0") and rounds.seat("a_1_0", closed) == 0
    assert rounds.close(0, ["x_1_0"], "x_1_0") == closed               # the first close stands
    assert rounds.seat("x_1_0", closed) is None and rounds.members(0) == ["a_1_0"]
    assert rounds.join("b_1_0", lease.id, -1, Place(0), None)[0] is False   # round 0 is closed
    assert rounds.look("b_1_0", -1).latest == 0
    assert rounds.join("a_1_0", lease.id, 0, Place(1), Place(0))[0] is True  # leaves round 0 as it joins 1
    assert rounds.count(join_prefix(etcd_client, "guards", 0)) == 0
    etcd_client.put(lost_key(etcd_client, "guards", "b_1_0"), "{}")
    assert rounds.join("b_1_0", lease.id, 0, Place(1), None)[0] is False    # marked lost: may not join


def test_a_closer_that_lost_its_claim_leaves_no_seat_behind(etcd_client):
    """Rank keys a closer wrote before its claim lapsed are dropped by the next closer, and a rank
    key another closer wrote is no seat in the round as closed."""
    rounds = Rounds(etcd_client, "stale", grace=5)
    lease = etcd_client.lease(30)
    for desc in ("a_1_0", "b_1_0", "c_1_0"):
        assert rounds.join(desc, lease.id, -1, Place(0), None)[0] is True
    stale = rank_key(etcd_client, "stale", 0, "c_1_0")
    etcd_client.put(stale, json.dumps({"rank": 2, "by": "a_1_0"}))     # a wrote c's seat, then lost the claim
    assert rounds.claim_closer("b_1_0", 0, lease.id)
    closed = rounds.close(0, ["a_1_0", "b_1_0"], "b_1_0")
    assert closed == Closed(0, 2, "b_1_0")
    assert rounds.seat("c_1_0", closed) is None and sorted(rounds.members(0)) == ["a_1_0", "b_1_0"]
    etcd_client.put(stale, json.dumps({"rank": 1, "by": "a_1_0"}))     # even one written after the close
    assert rounds.seat("c_1_0", closed) is None
    assert [rounds.seat(d, closed) for d in ("a_1_0", "b_1_0")] == [0, 1]


def test_a_closer_whose_claim_lapsed_stands_down_and_the_next_one_closes(etcd_client):
    """``Closer.step`` on a round it no longer holds the claim of: the close is refused, nothing
    is closed, the closer stands down (``abandoned``); another joiner claims and closes, and the
    first still gets its seat from the rank keys."""
    rounds = Rounds(etcd_client, "lapse", grace=5)
    lease = etcd_client.lease(30)
    for desc in ("a_1_0", "b_1_0"):
        assert rounds.join(desc, lease.id, -1, Place(0), None)[0] is True
    lost = LostNodes(etcd_client, "lapse")
    try:
        assert rounds.claim_closer("a_1_0", 0, lease.id)
        closer = Closer(rounds, lost, "a_1_0", 0, min_nodes=2, max_nodes=2, last_call=30.0)
        etcd_client.delete(closer_key(etcd_client, "lapse", 0))           # a's claim lapsed
        assert closer.step(rounds.check("a_1_0", 0, closer=True)) is None
        assert closer.abandoned and rounds.check("b_1_0", 0, closer=False).round_closed is None
        assert rounds.claim_closer("b_1_0", 0, lease.id)
        other = Closer(rounds, lost, "b_1_0", 0, min_nodes=2, max_nodes=2, last_call=30.0)
        closed = other.step(rounds.check("b_1_0", 0, closer=True))
        assert closed == Closed(0, 2, "b_1_0") and not other.abandoned
        assert [rounds.seat(d, closed) for d in ("a_1_0", "b_1_0")] == [0, 1]
    finally:
        lost.close()


# -- lost nodes and closers on a real etcd ------------------------------------------------------------------
def _params(etcd, prefix, run_id, min_nodes, max_nodes, **conf):
    conf.setdefault("join_timeout", "60")
    return RendezvousParameters("etcd3", etcd.endpoint, run_id, min_nodes, max_nodes, prefix=prefix, **conf)


def _join(handlers):
    results: list = [None] * len(handlers)

    def run(i):
        try:
            results[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_after_a_loss_the_survivors_round_closes_at_once_and_the_lost_torchrun_may_not_rejoin(
        etcd, etcd_prefix, etcd_client):
    params = _params(etcd, etcd_prefix, "loss", 2, 3, last_call_timeout="60")
    a, b, c = (create_etcd3_handler(params) for _ in range(3))
    try:
        first = _join([a, b, c])
        assert {r.world_size for r in first} == {3}          # max: closed at once
        etcd_client.put_json(lost_key(etcd_client, "loss", repr(b._this_node)), {"node": "b", "cause": "test"})
        began = time.monotonic()
        second = _join([a, c])                               # b's torchrun lives on and keeps its lease
        assert [r.world_size for r in second] == [2, 2]
        assert time.monotonic() - began < 30                 # neither the last call nor b's lease waited out
        record = etcd_client.get_json(round_key(etcd_client, "loss"))
        assert record["round"] == 1 and record["world_size"] == 2
        assert sorted(Rounds(etcd_client, "loss", 5).members(1)) == sorted(repr(h._this_node) for h in (a, c))
        with pytest.raises(RendezvousClosedError, match="declared this node"):
            b.next_rendezvous()
        assert b.shutdown() is False and not a.is_closed()  # on its way out it may not end the job
    finally:
        for h in (a, b, c):
            h._stop_heartbeats()
            h._release()


def test_a_closer_that_dies_is_replaced(etcd, etcd_prefix, etcd_client):
    lease = etcd_client.lease(2)
    etcd_client.put(closer_key(etcd_client, "takeover", 0), "10.9.9.9_4242_0", lease=lease)   # then it died
    params = _params(etcd, etcd_prefix, "takeover", 2, 2)
    handlers = [create_etcd3_handler(params) for _ in range(2)]
    try:
        results = _join(handlers)
        assert sorted(r.rank for r in results) == [0, 1]
        wait_for(lambda: etcd_client.get(closer_key(etcd_client, "takeover", 0))[0] != b"10.9.9.9_4242_0", 5,
                 "a new closer")
    finally:
        for h in handlers:
            h._stop_heartbeats()
            h._release()

"""Node loss and fencing decisions, pure: which loss restarts the workers, when a node fences."""

from __future__ import annotations

import pytest

from marind.agent.decisions import LossAction, fence_due, on_node_loss, stall_window
from marind.agent.membership import AGENT_RESTARTED, LEASE_EXPIRED, RECORD_DROPPED, Loss, loss_cause
from marind.rendezvous.lost import complete_early

pytestmark = pytest.mark.unit

TTL = 10.0
STALL = stall_window(TTL)


def test_the_stall_window_is_half_the_lease_ttl():
    assert stall_window(10) == 5.0 and stall_window(4) == 2.0


def _loss(**kw):
    args = {"in_round": True, "workers_running": True, "progress_at": 90.0, "now": 100.0, "stall_s": STALL}
    return on_node_loss(**{**args, **kw})


def test_a_silent_node_of_the_round_restarts_the_stalled_workers_at_once():
    action, why = _loss(progress_at=93.0)              # stuck for 7 s: the collective waits on it
    assert action == LossAction.RESTART and "new round" in why
    assert _loss(progress_at=None)[0] == LossAction.RESTART     # the round never reported: stuck too


def test_workers_that_still_step_wait_it_reaches_them_over_the_data_network():
    action, why = _loss(progress_at=98.0)
    assert action == LossAction.WAIT and "control network" in why
    assert _loss(progress_at=100.0 - STALL + 0.01)[0] == LossAction.WAIT
    assert _loss(progress_at=100.0 - STALL)[0] == LossAction.RESTART


def test_a_node_outside_the_round_or_no_running_workers_only_leave_the_rendezvous():
    assert _loss(in_round=False)[0] == LossAction.MARK
    assert _loss(workers_running=False)[0] == LossAction.MARK
    action, why = _loss(torchft=True)
    assert action == LossAction.MARK and "torchft" in why


def _fence(**kw):
    args = {"last_renewal": 80.0, "ttl": TTL, "now": 100.0, "progress_at": 85.0, "stall_s": STALL}
    return fence_due(**{**args, **kw})


def test_a_node_fences_once_its_lease_must_have_expired_and_its_workers_stalled():
    fence, why = _fence()
    assert fence and "20.0s" in why
    assert _fence(last_renewal=90.0)[0] is True         # exactly TTL: the lease may be gone
    assert _fence(progress_at=None)[0] is True


def test_no_fence_while_the_lease_may_live():
    fence, why = _fence(last_renewal=90.01)
    assert not fence and "renewed" in why


def test_no_fence_while_the_workers_step_etcd_alone_is_away():
    fence, why = _fence(progress_at=97.0)
    assert not fence and "etcd alone" in why


def test_the_cause_of_a_loss():
    assert loss_cause(False, None, "7") == LEASE_EXPIRED
    assert loss_cause(True, {"pid": 8}, "7") == AGENT_RESTARTED
    assert loss_cause(False, {"pid": 8}, "7") == AGENT_RESTARTED     # registered again by a new agent
    assert loss_cause(False, {"pid": 7}, "7") == RECORD_DROPPED


def test_a_loss_is_in_the_round_when_its_node_ran_workers():
    assert Loss("b", "1", LEASE_EXPIRED, {"workers": [{"rank": 1}]}).in_round
    assert not Loss("b", "1", LEASE_EXPIRED, {"workers": []}).in_round
    assert not Loss("b", "1", LEASE_EXPIRED).in_round


def _early(**kw):
    args = {"last_world": frozenset({"a", "b", "c"}), "lost": frozenset({"a"}),
            "participants": frozenset({"b", "c"}), "complete": False, "deadline_set": True}
    return complete_early(**{**args, **kw})


def test_a_round_after_a_loss_completes_once_every_survivor_joined():
    assert _early() is True
    assert _early(participants=frozenset({"b", "c", "d"})) is True


def test_otherwise_torch_waits_for_its_last_call():
    assert _early(participants=frozenset({"b"})) is False          # a survivor is missing
    assert _early(lost=frozenset({"x"})) is False                  # nobody of the last round was lost
    assert _early(lost=frozenset()) is False
    assert _early(complete=True) is False
    assert _early(deadline_set=False) is False                     # fewer than min_nodes
    assert _early(last_world=frozenset()) is False                 # a first round

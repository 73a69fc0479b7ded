"""Pure parts of the replica-drift check: the state digest, the decision, the test hook's syntax."""

from __future__ import annotations

import pytest
import torch

from marind.trainer.ft.drift import decide_drift, nudge_one_ulp, parse_drift_hook, state_digest

pytestmark = pytest.mark.unit


def _model_and_adam(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_digest_is_equal_for_equal_state_and_moves_with_one_ulp_of_a_parameter():
    a, opt_a = _model_and_adam()
    b, opt_b = _model_and_adam()
    assert state_digest(a, opt_a) == state_digest(b, opt_b)
    nudge_one_ulp(b)
    assert state_digest(a, opt_a) != state_digest(b, opt_b)
    assert 0 <= state_digest(b, opt_b) < 2 ** 62          # fits an int64 slot


def test_digest_covers_the_optimizer_state():
    a, opt_a = _model_and_adam()
    b, opt_b = _model_and_adam()
    p = next(iter(b.parameters()))
    state = opt_b.state[p]["exp_avg_sq"].view(-1)
    state[0] = torch.nextafter(state[0], torch.tensor(1.0))
    assert state_digest(a, opt_a) != state_digest(b, opt_b)


@pytest.mark.parametrize(("slots", "drifted"), [
    ([(30, 7), (30, 7)], ()),
    ([(30, 7), (30, 7), (30, 9)], (2,)),                 # majority
    ([(30, 9), (30, 7), (30, 7)], (0,)),                 # majority against replica rank 0
    ([(30, 7), (30, 9)], (1,)),                          # tie: replica rank 0's state kept
    ([(30, 7), (29, 3), (30, 7)], ()),                   # a group behind is torchft's to heal
    ([(30, 7), (29, 3), (30, 8)], (2,)),
    ([None, (30, 7), (30, 8)], (2,)),                    # the lowest present rank's state kept
    ([(30, 7), None], ()),
    ([(30, 1), (30, 2), (30, 1), (30, 2), (30, 3)], (1, 3, 4)),   # 2-2-1: no majority, rank 0's kept
])
def test_decide_drift(slots, drifted):
    decision = decide_drift(slots)
    assert decision.drifted == drifted, decision
    assert decision.reason
    if drifted:
        assert f"{list(drifted)}" in decision.reason


def test_drift_hook_syntax():
    assert parse_drift_hook(None) is None and parse_drift_hook("") is None
    assert parse_drift_hook("1:30") == (1, 30)
    with pytest.raises(ValueError, match="GROUP:STEP"):
        parse_drift_hook("1")


def test_drift_findings_become_one_event_when_found_and_one_when_healed():
    from marind.agent.progress import ProgressRecord, drift_findings

    def rec(rank, drift):
        return ProgressRecord(rank=rank, local_rank=rank, world_size=2, pid=1, step=31, loss=None, tokens_per_s=None,
                              last_checkpoint_step=None, phase="training", updated_at=0.0, replica_group=1,
                              drift=drift)
    seen: dict = {}
    found = {"step": 30, "reason": "differs", "healed": False}
    assert drift_findings([rec(0, None)], seen) == []
    assert drift_findings([rec(1, found), rec(0, found)], seen) == [
        {"replica_group": 1, "step": 30, "reason": "differs", "healed": False}]
    assert drift_findings([rec(0, found)], seen) == []
    healed = {**found, "healed": True}
    assert [e["healed"] for e in drift_findings([rec(0, healed), rec(1, healed)], seen)] == [True]
    assert drift_findings([rec(0, healed)], seen) == []


@pytest.mark.parametrize(("kw", "wait"), [
    ({"participants": 1, "previous": 2, "frozen_s": 9.0, "agent_file": True}, True),
    ({"participants": 2, "previous": 2, "frozen_s": 9.0, "agent_file": True}, False),    # not alone
    ({"participants": 1, "previous": 1, "frozen_s": 9.0, "agent_file": True}, False),    # alone before too
    ({"participants": 1, "previous": None, "frozen_s": 9.0, "agent_file": True}, False),  # first quorum
    ({"participants": 1, "previous": 3, "frozen_s": None, "agent_file": True}, False),   # the others left
    ({"participants": 1, "previous": 3, "frozen_s": 1.0, "agent_file": True}, False),    # a short hiccup
    ({"participants": 1, "previous": 2, "frozen_s": 9.0, "agent_file": False}, False),   # nothing to wait on
])
def test_decide_alone(kw, wait):
    from marind.trainer.ft.stale_lighthouse import decide_alone
    d = decide_alone(heartbeat_timeout=2.0, **kw)
    assert d.wait is wait and d.reason


def test_a_late_step_whose_peer_went_silent_at_the_lighthouse_is_not_committed():
    from marind.trainer.ft.abort import decide_late
    d = decide_late(7, 7, 9.0, heartbeat_timeout=2.0, silent="job_rg0:x")
    assert d.abort and "job_rg0:x silent" in d.reason
    assert not decide_late(7, 7, 1.0, heartbeat_timeout=2.0, silent="job_rg0:x").abort   # quick: never checked


def test_freeze_watch_sees_the_process_stand_still():
    import sys
    import time

    from marind.trainer.ft.stale_lighthouse import FreezeWatch
    watch = FreezeWatch(0.5)
    time.sleep(0.6)
    since = time.monotonic()
    assert watch.frozen_since(since) is None
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)          # the watch thread gets no GIL while this thread spins
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)
    time.sleep(0.6)
    frozen = watch.frozen_since(since)
    assert frozen is not None and frozen > 0.5
    assert watch.frozen_since(time.monotonic()) is None

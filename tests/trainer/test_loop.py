"""The shared training loop's seam and its small decisions (pure: no process group is started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from marind.core.workerenv import WorkerEnv
from marind.trainer.config import TrainerSpec
from marind.trainer.loop import LoopState, Result, TrainMode, log_due, stop_here
from marind.trainer.train import ElasticMode, nan_steps

pytestmark = pytest.mark.unit


def _spec(**sections) -> TrainerSpec:
    data = {"job": {"name": "j", "nodes": "1", "nproc_per_node": 1},
            "data": {"path": "d", "seq_len": 8, "global_batch": 4, "micro_batch": 2},
            "train": {"steps": 25, "log_every": 10}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainerSpec.from_dict(data, check_worlds=False)


def test_log_due_every_n_steps_and_the_last():
    spec = _spec()
    assert [s for s in range(1, 26) if log_due(s, spec)] == [10, 20, 25]


def test_nan_steps_from_spec_and_environment():
    env = WorkerEnv.from_environ({"MARIND_TEST_NAN_AT_STEP": "3, 5"})
    assert nan_steps(_spec(fault={"nan_at_step": 7}), env) == {3, 5, 7}
    assert nan_steps(_spec(), WorkerEnv.from_environ({})) == set()


def test_elastic_mode_steps_and_positions():
    run = SimpleNamespace(spec=_spec())     # next_step and advance read the spec only
    mode, state = ElasticMode(), LoopState()
    seen = []
    while mode.next_step(run, state):
        seen.append((state.step, state.position))
        mode.advance(run, state, committed=True)
    assert seen[:3] == [(0, 0), (1, 4), (2, 8)] and len(seen) == 25 and state.step == 25


def test_a_mode_must_implement_every_required_hook():
    class Partial(TrainMode):
        def start(self, run, state):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_result_as_dict():
    r = Result(3, 12, 1.5, [2.0, 1.5], [2], 0, False, None)
    assert r.as_dict() == {"step": 3, "data_position": 12, "loss": 1.5, "losses": [2.0, 1.5], "skipped_steps": [2],
                           "rollbacks": 0, "stopped": False, "last_checkpoint_step": None}


class _FakeManager:
    """The few Manager calls TorchftMode's decisions make."""

    def __init__(self, *, commit=True, rank=0, step=0):
        self.commit, self.rank, self.step, self.errors = commit, rank, step, []

    def report_error(self, exc):
        self.errors.append(exc)

    def should_commit(self):
        return self.commit and not self.errors

    def participating_rank(self):
        return self.rank

    def current_step(self):
        return self.step


def _torchft(manager):
    import torch

    from marind.trainer.ft.group import LighthouseSource
    from marind.trainer.ft.train import TorchftMode
    from marind.trainer.loop import StopFlag

    mode = TorchftMode(1, StopFlag(), LighthouseSource(None, "http://x:1"))
    mode._ft = SimpleNamespace(manager=manager)
    saved = SimpleNamespace(last_step=None, enabled=True, due=lambda step: step % 10 == 0)
    run = SimpleNamespace(spec=_spec(fault={"mode": "torchft", "replica_groups": 3}), ckpt=saved)
    return mode, run, torch


def test_torchft_commit_follows_the_manager_and_reports_non_finite_norms():
    m = _FakeManager()
    mode, run, torch = _torchft(m)
    state = LoopState(step=4)
    assert mode.commit(run, state, torch.tensor(1.0)) is True and not m.errors
    assert mode.commit(run, state, torch.tensor(float("inf"))) is False
    assert "step 5" in str(m.errors[0])


def test_torchft_saves_on_replica_rank_0_of_committed_due_steps_only():
    m = _FakeManager(rank=0)
    mode, run, _ = _torchft(m)
    assert mode.save_due(run, LoopState(step=10), committed=True, time_due=False)
    assert not mode.save_due(run, LoopState(step=10), committed=False, time_due=True)
    assert not mode.save_due(run, LoopState(step=11), committed=True, time_due=True)
    m.rank = 1
    assert not mode.save_due(run, LoopState(step=10), committed=True, time_due=False)
    assert not mode.final_save_due(run, LoopState(step=25))
    m.rank = 0
    assert mode.final_save_due(run, LoopState(step=25))
    run.ckpt.last_step = 25
    assert not mode.final_save_due(run, LoopState(step=25))


def test_torchft_step_and_position_are_the_managers():
    m = _FakeManager(step=7)
    mode, run, _ = _torchft(m)
    state = LoopState()
    mode.advance(run, state, committed=True)
    assert (state.step, state.position) == (7, 7 * 4 * 3)    # global_batch 4 per group, 3 groups


def test_the_test_stop_hook_is_off_at_zero_even_while_the_step_stays_at_zero():
    # torchft: a first step that no quorum committed leaves the counter at 0; with the
    # hook unset (0) that must not read as "stop at step 0" (it used to: exit 143).
    assert not stop_here(False, 0, 0)
    assert not stop_here(False, 5, 0)
    assert stop_here(False, 5, 5)
    assert not stop_here(False, 4, 5)
    assert stop_here(True, 0, 0)

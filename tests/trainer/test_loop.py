"""The shared training loop's seam and its small decisions (pure: no process group is started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from marind.core.spec import RunSpec
from marind.core.workerenv import WorkerEnv
from marind.trainer.loop import LoopState, Result, TrainMode, log_due
from marind.trainer.train import ElasticMode, nan_steps

pytestmark = pytest.mark.unit


def _spec(**sections) -> RunSpec:
    data = {"job": {"name": "j", "nodes": "1", "nproc_per_node": 1},
            "data": {"path": "d", "seq_len": 8, "global_batch": 4, "micro_batch": 2},
            "train": {"steps": 25, "log_every": 10}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return RunSpec.from_dict(data, check_worlds=False)


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

"""The compute timer: time inside its blocks only, the straggler hook slept once per step inside them."""

from __future__ import annotations

import pytest
import torch

from marind.trainer import compute_time
from marind.trainer.compute_time import ComputeTimer

pytestmark = pytest.mark.unit


def test_only_time_inside_blocks_counts_and_the_hook_sleeps_once_per_step(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(compute_time.time, "sleep", lambda s: slept.append(s))
    monkeypatch.setenv("MARIND_TEST_COMPUTE_SLEEP", "0.25")
    clock = iter([10.0, 11.0, 20.0, 20.5, 30.0, 30.25])
    monkeypatch.setattr(compute_time.time, "perf_counter", lambda: next(clock))
    timer = ComputeTimer(torch.device("cpu"))
    with timer:
        pass
    with timer:          # a second block in the same step: no second sleep
        pass
    assert timer.take() == 1.5 and slept == [0.25]
    with timer:
        pass
    assert timer.take() == 0.25 and slept == [0.25, 0.25]


@pytest.mark.parametrize("bad", ["x", "-1"])
def test_a_bad_hook_value_is_one_clear_error(monkeypatch, bad):
    monkeypatch.setenv("MARIND_TEST_COMPUTE_SLEEP", bad)
    with pytest.raises(ValueError, match="MARIND_TEST_COMPUTE_SLEEP"):
        ComputeTimer(torch.device("cpu"))

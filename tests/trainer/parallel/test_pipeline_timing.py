"""The measured pipeline bubble's arithmetic and the per-rank peak memory read (no processes)."""

from __future__ import annotations

import pytest
import torch

from marind.core import workerenv
from marind.trainer.parallel.pipeline_timing import (
    StageTimer,
    bubble_of_ranks,
    measured_bubble,
    schedule_bubble,
    timing_skip,
)
from marind.trainer.peak_memory import parse_vm_hwm, peak_memory, peak_rss_bytes

pytestmark = pytest.mark.unit


def test_schedule_bubble_is_the_fill_and_drain_share():
    assert schedule_bubble(1, 8) == 0
    assert schedule_bubble(2, 8) == pytest.approx(1 / 9)
    assert schedule_bubble(4, 4) == pytest.approx(3 / 7)
    assert schedule_bubble(2, 8, stages_per_rank=2) == pytest.approx(1 / 17)   # interleaving shrinks it
    with pytest.raises(ValueError, match="must be >= 1"):
        schedule_bubble(2, 0)


def test_measured_bubble_is_the_idle_share_within_0_and_1():
    assert measured_bubble(3.0, 4.0) == pytest.approx(0.25)
    assert measured_bubble(0.0, 2.0) == 1.0
    assert measured_bubble(4.0001, 4.0) == 0.0          # clock jitter never gives a negative bubble
    for busy, wall in ((1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="wall time must be > 0"):
            measured_bubble(busy, wall)


def test_bubble_of_ranks_needs_every_rank_timed():
    ranks = [{"pp_busy_s": 3.0, "pp_wall_s": 4.0, "pp_timed_steps": 5.0},
             {"pp_busy_s": 2.0, "pp_wall_s": 4.0, "pp_timed_steps": 5.0}]
    assert bubble_of_ranks(ranks) == {"per_rank": [0.25, 0.5], "mean": 0.375}
    assert bubble_of_ranks([ranks[0], {"peak_memory_bytes": 1.0}]) == {}   # a rank without timing: none
    assert bubble_of_ranks([]) == {}


def test_timing_is_off_unless_the_variable_is_set():
    assert timing_skip({}) is None and timing_skip({workerenv.BENCH_PP_TIMING: " "}) is None
    assert timing_skip({workerenv.BENCH_PP_TIMING: "5"}) == 5
    with pytest.raises(ValueError, match="MARIND_BENCH_PP_TIMING = '-1' must be an integer >= 0"):
        timing_skip({workerenv.BENCH_PP_TIMING: "-1"})
    assert StageTimer.from_environ([], object(), torch.device("cpu"), environ={}) is None


class _Stage:
    """Stands in for a PipelineStage: what it computes takes ``cost`` seconds of the fake clock."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self.clock, self.cost, self.calls = clock, cost, 0

    def forward_one_chunk(self, *args, **kwargs):
        self.calls += 1
        self.clock[0] += self.cost

    def backward_one_chunk(self, *args, **kwargs):
        self.calls += 1
        self.clock[0] += 2 * self.cost


def test_stage_timer_counts_compute_against_the_schedule_run_after_warm_up():
    now = [0.0]
    stage = _Stage(now, 1.0)
    timer = StageTimer(skip_steps=1, device=torch.device("cpu"), clock=lambda: now[0])
    timer.wrap(stage, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"))
    assert not hasattr(stage, "backward_weight_one_chunk")   # only what the object has is wrapped
    for step_index in range(3):              # step 1 is warm-up: not timed
        timer.begin(step_index)
        now[0] += 1.0                        # waiting for the other stage
        stage.forward_one_chunk(0)
        stage.backward_one_chunk(0)
        now[0] += 1.0
        timer.end()
    assert stage.calls == 6 and timer.timed_steps == {2, 3}
    m = timer.metrics()
    assert (m["pp_busy_s"], m["pp_wall_s"], m["pp_timed_steps"]) == (6.0, 10.0, 2.0)
    assert m["pp_bubble"] == pytest.approx(0.4)
    stage.forward_one_chunk(0)              # outside a schedule run: not counted
    assert timer.metrics()["pp_busy_s"] == 6.0


def test_no_metrics_before_a_timed_step():
    timer = StageTimer(skip_steps=5, device=torch.device("cpu"), clock=lambda: 0.0)
    timer.begin(0)
    timer.end()
    assert timer.metrics() == {}


def test_vm_hwm_parsing_and_this_process_peak():
    assert parse_vm_hwm("Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n") == 2048 * 1024
    assert parse_vm_hwm("Name:\tpython\n") is None and parse_vm_hwm("VmHWM:\tlots kB\n") is None
    big = torch.ones(64 * 2 ** 20 // 4)      # 64 MiB touched: the high-water mark is at least that
    assert peak_rss_bytes() >= big.numel() * 4
    m = peak_memory(torch.device("cpu"))
    assert m["peak_memory_bytes"] == m["peak_rss_bytes"] >= big.numel() * 4
    assert "peak_cuda_allocated_bytes" not in m

"""bench/goodput.py --memory-ckpt both: the memory runs' ratios against the runs without."""

from __future__ import annotations

import pytest

from bench.goodput import memory_fields

pytestmark = pytest.mark.unit


def test_memory_fields_compare_each_fault_kind_and_the_step_time():
    baseline = {"goodput": 0.98, "steps_kept": 100, "kept_step_s": 50.0}
    baseline_mem = {"goodput": 0.96, "steps_kept": 100, "kept_step_s": 54.0}
    runs = {"kill": {"goodput": 0.90}, "power_off": {"goodput": 0.80}}
    runs_mem = {"kill": {"goodput": 0.95}, "power_off": {"goodput": 0.92}}
    out = memory_fields(baseline, baseline_mem, runs, runs_mem)
    assert out["ratios"] == {"kill_memory_goodput_over_elastic": 1.0556,
                             "power_off_memory_goodput_over_elastic": 1.15,
                             "memory_step_slowdown": 1.08}
    assert out["faults_memory"] is runs_mem and out["baseline_memory"] is baseline_mem


def test_memory_fields_without_a_fault_free_memory_run_say_no_slowdown():
    out = memory_fields({"steps_kept": 0, "kept_step_s": 0.0}, None, {}, {"kill": {"goodput": 0.9}})
    assert out["ratios"] == {} and "baseline_memory" not in out

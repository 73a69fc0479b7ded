"""The multi-process helper runs real gloo ranks and reports failures and hangs."""

from __future__ import annotations

import pytest

from marind.testing.procs import WorkersFailed, run_torch_workers


def test_gloo_allreduce_across_processes():
    results = run_torch_workers("tests.support.sample_workers:allreduce_rank", 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 3.0 and r["world"] == 3 for r in results)


def test_failing_rank_is_reported_with_its_output():
    with pytest.raises(WorkersFailed, match="deliberate failure on rank 1"):
        run_torch_workers("tests.support.sample_workers:fail_on_rank", 2, timeout=60, rank=1)


def test_hung_workers_time_out_and_are_killed():
    with pytest.raises(WorkersFailed, match="timeout"):
        run_torch_workers("tests.support.sample_workers:sleep_forever", 2, timeout=8)

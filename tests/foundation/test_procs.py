"""The multi-process helper runs real gloo ranks and reports failures and hangs."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from marind.testing.procs import WorkersFailed, base_env, run_torch_workers


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


_SIGTERMED_BENCH = """
import sys, time
from marind.testing.procs import exit_on_sigterm
exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("cleaned up")
"""


def test_a_bench_stopped_by_sigterm_runs_its_cleanup(tmp_path):
    """A bench started in a shell's background ignores SIGINT; SIGTERM must still undo its servers
    and bed (the ``finally`` blocks), which SIGTERM's default action skips."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERMED_BENCH, str(marker)], stdout=subprocess.PIPE,
                            env=base_env(), text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.read_text() == "cleaned up"

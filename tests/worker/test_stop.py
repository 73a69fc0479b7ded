"""``should_stop``: a real SIGTERM in this process, and agreement across real gloo ranks."""

from __future__ import annotations

import os
import signal

import pytest

from marind.testing.procs import run_torch_workers
from marind.worker import stop


@pytest.fixture
def fresh_flag(monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(stop, "_flag", stop.StopFlag())
    monkeypatch.setattr(stop, "_agreed", False)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.unit
def test_sigterm_sets_the_flag_once_installed(fresh_flag):
    assert stop.should_stop() is False        # installs the handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.should_stop() is True
    assert stop.should_stop() is True          # sticky


@pytest.mark.timeout(300)
def test_ranks_agree_on_the_step_to_stop_at():
    results = run_torch_workers("tests.worker.workers:stop_together", 2, timeout=240,
                                signal_rank=1, signal_at=3, steps=50)
    assert [r["stopped_at"] for r in results] == [3, 3]   # rank 0 got no signal, and stops with rank 1
    assert all(r["again"] for r in results)


@pytest.mark.timeout(600)
def test_sigterm_to_torchrun_saves_at_an_agreed_step_and_resumes_exactly(tmp_path):
    """SIGTERM to torchrun (what a cancel does): both ranks leave at one step, save it, and a new
    start resumes there and ends bit-identical to a run that was never stopped."""
    import subprocess

    from marind.core.progress import read_records
    from tests.agent.helpers import wait_for
    from tests.worker.test_own_scripts import STEPS, digests, run_script, start_script, starts

    proc, base = start_script(tmp_path, "mlp_ddp.py", "stopped", env={"WORKER_TEST_STEP_SLEEP": "0.5"})
    log = lambda: (base / "torchrun.log").read_text(errors="replace")[-4000:]
    wait_for(lambda: len(recs := read_records(base / "run")) == 2 and min(r.step for r in recs) >= 2, 120,
             "both ranks past step 2", diag=log)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not stop\n{log()}") from None
    stopped = digests(base / "out")
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step and 2 <= step < STEPS, log()
    assert [(r.step, r.phase, r.last_checkpoint_step) for r in read_records(base / "run")] == [(step, "done", step)] * 2

    resumed = run_script(tmp_path, "mlp_ddp.py", "stopped")          # the same job started again
    assert [s["loaded"] for s in starts(resumed)[2:]] == [step, step]
    assert digests(resumed) == digests(run_script(tmp_path, "mlp_ddp.py", "clean"))

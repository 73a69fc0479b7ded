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

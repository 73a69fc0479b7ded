"""RunMonitor reading torchrun.log and rank 0's progress: restarts with reasons, checkpoint commits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marind.agent.metrics import Metrics
from marind.agent.run_monitor import RunMonitor
from marind.agent.supervisor import WorkerProc
from marind.control.failure_causes import CAUSES
from marind.control.lifecycle import JobEvent
from marind.core.spec import load_spec
from tests.agent.test_run_monitor import SPEC, FakeOutbox, FakeTorchrun
from tests.agent.test_worker_errors import FAILED, MISSING, TRACEBACK

pytestmark = pytest.mark.unit


def _monitor(tmp_path: Path, max_restarts: int = 2) -> tuple[RunMonitor, FakeTorchrun, FakeOutbox, Metrics]:
    (tmp_path / "logs").mkdir(exist_ok=True)
    log = tmp_path / "logs" / "torchrun.log"
    log.write_text("--- an earlier run\n" + TRACEBACK + FAILED.format(code=1, pid=1))   # not this run's
    sup = FakeTorchrun(tmp_path, [WorkerProc(101, 0, 0), WorkerProc(102, 1, 1)])
    outbox, metrics = FakeOutbox(), Metrics()
    spec = load_spec(SPEC.replace("[job]\n", f"[job]\nmax_restarts = {max_restarts}\n"))
    run = RunMonitor("j", spec, sup, node="n1", outbox=outbox, metrics=metrics,  # type: ignore[arg-type]
                     log_offset=log.stat().st_size)
    return run, sup, outbox, metrics


def _log(tmp_path: Path, text: str) -> None:
    with open(tmp_path / "logs" / "torchrun.log", "a") as fh:
        fh.write(text)


def _rank0(run_dir: Path, step: int, ckpt: int | None, at: float, phase: str = "training") -> None:
    d = run_dir / "progress"
    d.mkdir(parents=True, exist_ok=True)
    (d / "rank-0.json").write_text(json.dumps({"rank": 0, "local_rank": 0, "world_size": 2, "pid": 101,
                                               "step": step, "loss": 2.5, "tokens_per_s": 100.0,
                                               "last_checkpoint_step": ckpt, "phase": phase, "updated_at": at}))


def test_rounds_that_died_between_ticks_are_counted_from_the_log(tmp_path):
    run, sup, outbox, metrics = _monitor(tmp_path)
    run.supervise(0.0)
    assert run.restarts == 0                                   # the earlier run's failure is not counted
    _log(tmp_path, TRACEBACK + FAILED.format(code=1, pid=101) + TRACEBACK + FAILED.format(code=1, pid=301))
    run.supervise(1.0)                                         # two rounds failed; the tick saw neither
    assert run.restarts == 2
    restarts = [d for k, d in outbox.events if k == "restart"]
    because = f"rank 0 (local 0) on n1: {MISSING}; fix: {CAUSES['data_missing']}"   # rank 0: the one torchrun named
    assert [(d["restarts"], d["reason"], d["round"]) for d in restarts] == [(1, because, 2), (2, because, 3)]
    assert [(d["cause"], d["rank"], d["exitcode"]) for d in restarts] == [("data_missing", 0, 1)] * 2
    assert outbox.states[-1] == (JobEvent.RESTART, f"workers restarted on n1: {because}")
    errors = [d for k, d in outbox.events if k == "last_error"]
    assert errors[-1]["line"] == because and errors[-1]["node"] == "n1" and errors[-1]["source"] == "log"
    sup._workers = [WorkerProc(401, 0, 0), WorkerProc(402, 1, 1)]
    run.supervise(2.0)                                         # the round after them: no third restart
    assert run.restarts == 2 and run.generations == 2
    _log(tmp_path, TRACEBACK + FAILED.format(code=1, pid=401))
    run.supervise(3.0)                                         # max_restarts used up: torchrun gives up
    assert run.restarts == 2 and len([k for k, _ in outbox.events if k == "restart"]) == 2
    assert run.exit_reason(4.0) == because
    assert metrics.value("marind_job_restarts_total", job="j") == 2


def test_a_round_without_a_failure_here_is_a_restart_too(tmp_path):
    run, sup, outbox, _ = _monitor(tmp_path)
    run.supervise(0.0)
    sup._workers = [WorkerProc(201, 0, 0)]
    run.supervise(1.0)
    assert run.restarts == 1 and "nodes changed" in outbox.events[-1][1]["reason"]


def test_the_error_file_wins_at_exit(tmp_path):
    run, _, outbox, _ = _monitor(tmp_path)
    (tmp_path / "logs" / "error.json").write_text(json.dumps({"message": {"message": "OSError: disk full"}}))
    assert run.exit_reason(1.0) == "OSError: disk full"
    assert outbox.events[-1][1]["source"] == "error_file"


def test_checkpoint_commits_are_events_with_durations(tmp_path):
    run, _, outbox, metrics = _monitor(tmp_path)
    _rank0(tmp_path, 0, None, 10.0, phase="restoring")
    run.supervise(10.0)
    _rank0(tmp_path, 100, 100, 11.0)                           # resumed at 100: a restore, not a commit
    run.supervise(11.0)
    _rank0(tmp_path, 150, 100, 20.0)                           # step 150 done; its save is in flight
    run.supervise(20.0)
    _rank0(tmp_path, 152, 150, 23.5)                           # committed
    run.supervise(23.5)
    commits = [d for k, d in outbox.events if k == "checkpoint_committed"]
    assert commits == [{"step": 150, "duration_s": 3.5}]
    text = metrics.render()
    assert 'marind_checkpoint_duration_seconds_count{job="j"} 1' in text
    assert 'marind_job_last_checkpoint_step{job="j"} 150' in text and 'marind_job_step{job="j"} 152' in text
    assert 'marind_job_loss{job="j"} 2.5' in text and 'marind_job_tokens_per_second{job="j"} 100' in text

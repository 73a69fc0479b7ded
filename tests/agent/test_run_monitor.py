"""RunMonitor with a fake torchrun and outbox: rounds, and hangs handled without blocking the tick."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from marind.agent.decisions import HANG_DUMP_WAIT_S
from marind.agent.metrics import Metrics
from marind.agent.run_monitor import RunMonitor
from marind.agent.supervisor import WorkerProc
from marind.control.lifecycle import JobEvent
from marind.core.spec import load_spec

pytestmark = pytest.mark.unit

NEW_ROUND = "a new rendezvous round: the job's nodes changed or another node's workers failed"

SPEC = """
[job]
name = "h"
nproc_per_node = 2
hang_timeout = "4s"
[data]
path = "d"
global_batch = 4
micro_batch = 1
"""


class FakeTorchrun:
    """What RunMonitor uses of a TorchrunSupervisor, with no process behind it."""

    def __init__(self, run_dir: Path, workers: list[WorkerProc]):
        self.run_dir, self.pid, self.stopping = run_dir, 42, False
        self._workers = workers
        self.signals: list[tuple[int, tuple[int, ...]]] = []

    def workers(self) -> list[WorkerProc]:
        return list(self._workers)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def poll(self) -> int | None:
        return None

    def signal_workers(self, sig: int, pids=None) -> list[int]:
        pids = tuple(self.worker_pids() if pids is None else pids)
        self.signals.append((sig, pids))
        return list(pids)


class FakeOutbox:
    node = "a"                     # the straggler watch names its node in its log lines

    def __init__(self):
        self.states: list[tuple[JobEvent, str]] = []
        self.events: list[tuple[str, dict]] = []

    def state(self, job, event, *, reason, restarts=None, step=None):
        self.states.append((event, reason))

    def event(self, job, kind, detail):
        self.events.append((kind, detail))

    def last_error(self, job, record):
        self.events.append(("last_error", record))


def _progress(run_dir: Path, rank: int, pid: int, step: int, phase: str = "training") -> None:
    d = run_dir / "progress"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "local_rank": rank, "world_size": 2,
                                                     "pid": pid, "step": step, "phase": phase}))


def _monitor(tmp_path: Path) -> tuple[RunMonitor, FakeTorchrun, FakeOutbox]:
    sup = FakeTorchrun(tmp_path, [WorkerProc(101, 0, 0), WorkerProc(102, 1, 1)])
    outbox = FakeOutbox()
    run = RunMonitor("j", load_spec(SPEC), sup, node="n1", outbox=outbox, metrics=Metrics())  # type: ignore[arg-type]
    return run, sup, outbox


def test_first_round_starts_the_job(tmp_path):
    run, _, outbox = _monitor(tmp_path)
    _progress(tmp_path, 0, 101, 3)
    run.supervise(0.0)
    assert run.generations == 1 and run.restarts == 0 and run.step == 3
    assert outbox.states == [(JobEvent.WORKERS_STARTED, "workers started on n1")]


def test_a_hang_is_dumped_then_killed_on_a_later_tick(tmp_path):
    run, sup, outbox = _monitor(tmp_path)
    _progress(tmp_path, 0, 101, 5)
    _progress(tmp_path, 1, 102, 5)
    run.supervise(0.0)
    run.supervise(3.0)
    assert sup.signals == [] and run.pending_kill is None
    run.supervise(5.0)                                   # stalled > hang_timeout: stacks dumped, no kill yet
    assert sup.signals == [(signal.SIGUSR1, (101, 102))]
    assert run.pending_kill is not None and run.pending_kill.kill_at == 5.0 + HANG_DUMP_WAIT_S
    assert not any(kind == "hang_detected" for kind, _ in outbox.events)
    run.supervise(5.0 + HANG_DUMP_WAIT_S / 2)            # still dumping: the tick returns at once
    assert len(sup.signals) == 1
    run.supervise(5.0 + HANG_DUMP_WAIT_S)
    assert sup.signals[-1] == (signal.SIGKILL, (101, 102))
    hang = [detail for kind, detail in outbox.events if kind == "hang_detected"]
    assert len(hang) == 1
    assert hang[0]["stack_dumped"] == [101, 102] and hang[0]["killed"] == [101, 102]
    assert hang[0]["ranks"] == [0, 1] and "hang_timeout 4s" in hang[0]["reason"]
    assert run.pending_kill is None
    run.supervise(8.0)                                   # the detector was re-armed
    assert len(sup.signals) == 2


def test_a_pending_kill_happens_at_once_when_torchrun_exits(tmp_path):
    run, sup, outbox = _monitor(tmp_path)
    _progress(tmp_path, 0, 101, 5)
    run.supervise(0.0)
    run.supervise(5.0)
    assert [s for s, _ in sup.signals] == [signal.SIGUSR1]
    run.settle_hang(5.1)
    assert [s for s, _ in sup.signals] == [signal.SIGUSR1, signal.SIGKILL]
    assert [kind for kind, _ in outbox.events] == ["hang_detected"]
    run.settle_hang(6.0)                                 # nothing pending: nothing more
    assert len(sup.signals) == 2


def test_a_new_round_is_a_restart(tmp_path):
    run, sup, outbox = _monitor(tmp_path)
    run.supervise(0.0)
    sup._workers = [WorkerProc(201, 0, 0), WorkerProc(202, 1, 1)]
    run.supervise(1.0)
    assert (run.generations, run.restarts, run.awaiting_running_since) == (2, 1, 1.0)
    assert outbox.states[-1] == (JobEvent.RESTART, f"workers restarted on n1: {NEW_ROUND}")
    assert outbox.events == [("restart", {"round": 2, "restarts": 1, "reason": NEW_ROUND})]
    _progress(tmp_path, 0, 201, 9)
    run.supervise(2.0)
    assert outbox.states[-1] == (JobEvent.WORKERS_STARTED, "workers running (round 2)")
    assert run.awaiting_running_since is None

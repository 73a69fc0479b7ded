"""A hung round's workers: their stacks dumped, then killed, without blocking the agent's tick.

The ``RunMonitor`` keeps one ``HangKiller`` per run and calls ``tick`` with the current
round's workers and progress records. A round whose stall marker has not changed for the
job's ``hang_timeout`` (``hang.HangDetector``) is hung: its workers get SIGUSR1
(faulthandler dumps their stacks into ``logs/torchrun.log``), and ``HANG_DUMP_WAIT_S``
later, on a later tick, SIGKILL; then the ``hang_detected`` event is written. When
torchrun exits or the run is stopped meanwhile, ``settle`` kills at once. The decisions
are ``decisions.on_hang``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marind.agent import progress as prog
from marind.agent.decisions import HANG_DUMP_WAIT_S, HangAction, on_hang
from marind.agent.hang import HangDetector
from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.supervisor import TorchrunSupervisor, WorkerProc


@dataclass(frozen=True)
class PendingKill:
    """Hung workers whose stacks are being dumped; they are killed at ``kill_at``."""

    kill_at: float
    pids: tuple[int, ...]        # the workers signalled with SIGUSR1 (the ones to kill)
    dumped: list[int]            # those the signal reached
    why: str
    ranks: list[int]             # ranks of the progress records at detection


class HangKiller:
    """Hang detection and its dump-then-kill for one run.

    Args:
        job: the job's id.
        sup: the job's torchrun on this node.
        hang_timeout: the stall that counts as a hang (the job's ``hang_timeout``).
        outbox: where the ``hang_detected`` event goes.
        metrics: the agent's metrics.
        log: the run's logger.
        log_path: ``logs/torchrun.log`` (where the stacks go; named in the event).
    """

    def __init__(self, job: str, sup: TorchrunSupervisor, *, hang_timeout: float, outbox: Outbox,
                 metrics: Metrics, log: Any, log_path: Path):
        self.job, self.sup, self.outbox, self.metrics, self.log = job, sup, outbox, metrics, log
        self.log_path = log_path
        self.detector = HangDetector(hang_timeout)
        self.pending: PendingKill | None = None

    def new_round(self) -> None:
        """A new rendezvous round: the detector re-arms."""
        self.detector.reset()

    def tick(self, now: float, workers: list[WorkerProc], records: list[prog.ProgressRecord]) -> None:
        """Watch the round for a hang; dump the stacks of a hung one, kill it once they are dumped."""
        hung, why = False, ""
        if self.pending is None:
            if not workers or prog.all_done(records):
                return
            self.detector.observe(now, prog.stall_marker(records))
            hung, why = self.detector.check(now)
        self._act(now, hung, why, records, torchrun_exited=False)

    def settle(self, now: float) -> None:
        """torchrun exited or the run is being stopped: a pending kill happens now."""
        if self.pending is not None:
            self._act(now, False, "", [], torchrun_exited=True)

    def drop_pending(self) -> None:
        """Forget a pending kill without its event (the run was fenced: everything is dead already)."""
        self.pending = None

    def _act(self, now: float, hung: bool, why: str, records: list[prog.ProgressRecord], *,
             torchrun_exited: bool) -> None:
        pending = self.pending
        action, _ = on_hang(now=now, hung=hung, why=why, kill_at=pending.kill_at if pending else None,
                            torchrun_exited=torchrun_exited)
        if action == HangAction.DUMP:
            self.log.warning("hang_detected", reason=why)
            self.metrics.inc("marind_hangs_total")
            pids = tuple(self.sup.worker_pids())
            dumped = self.sup.signal_workers(signal.SIGUSR1, pids)    # faulthandler: stacks into the log
            self.pending = PendingKill(now + HANG_DUMP_WAIT_S, pids, dumped, why, [r.rank for r in records])
        elif action == HangAction.KILL and pending is not None:
            killed = self.sup.signal_workers(signal.SIGKILL, pending.pids)
            self.outbox.event(self.job, "hang_detected", {"reason": pending.why, "ranks": pending.ranks,
                                                          "stack_dumped": pending.dumped, "killed": killed,
                                                          "stack_dump": str(self.log_path)})
            self.pending = None
            self.detector.reset()

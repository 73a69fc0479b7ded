"""Why this node's workers failed, round by round: the first failed rank's cause, not its echo.

The ``RunMonitor`` of a run keeps one :class:`FailureWatch`. Every tick it notes the round's
workers (``note``: which global rank each local rank is, and each worker's memory cgroup for
``oom_watch``) and reads what torchrun's log gained (``read``). For each round torchrun reports
failed (``worker_errors.LogScan``) it decides the cause (``failure_causes.cause_of``):

* the rank torchrun names is described by its *own* last exception line (torch prefixes a
  rank's traceback with ``[rankN]:``), never by another rank's: rank 0's "Connection closed by
  peer" printed while rank 1 was being SIGKILLed is not rank 1's reason;
* a SIGKILL is checked against the rank's memory cgroup and the kernel log (the OOM killer);
* when the named rank's error is only an echo (a peer gone), a rank of this node that failed on
  its own (its own error that is no echo, or an OOM kill) is named instead;
* a collective timeout names the ranks of the round that did not time out themselves.

Each cause comes with its facts for the ``restart`` event and ``last_error``
(``exitcode``, ``local_rank``, ``rank``, ``cause``, ``fix``, ``echo``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from marind.agent.oom_watch import OomWatch
from marind.agent.supervisor import WorkerProc
from marind.agent.worker_errors import Failure, LogScan, LogTail
from marind.control.failure_causes import Cause, cause_of, error_kind


class FailureWatch:
    """torchrun's failed rounds on this node and their causes.

    Args:
        node: this node's name.
        run_dir: the job's run dir (its ``logs/torchrun.log``).
        log_offset: the log's size before this torchrun started.
        oom: the OOM evidence (a fresh ``OomWatch`` when None).
    """

    def __init__(self, node: str, run_dir: Path, log_offset: int = 0, oom: OomWatch | None = None,
                 nproc_per_node: int | None = None):
        self.node = node
        self.nproc_per_node = nproc_per_node
        self.tail = LogTail(run_dir / "logs" / "torchrun.log", log_offset)
        self.scan = LogScan()
        self.oom = oom if oom is not None else OomWatch()
        self._ranks: dict[int, tuple[int | None, int]] = {}   # local rank -> (global rank, worker pid), latest
        self.last: Cause | None = None

    def note(self, workers: Iterable[WorkerProc]) -> None:
        """The round's live workers: their ranks and memory cgroups."""
        workers = list(workers)
        for w in workers:
            if w.local_rank is not None:
                self._ranks[w.local_rank] = (w.rank, w.pid)
        self.oom.note([w.pid for w in workers])

    def read(self) -> list[tuple[Failure, Cause, dict[str, Any]]]:
        """The failed rounds the log gained since the last call, each with its cause and facts."""
        out = []
        for failure in self.scan.feed(self.tail.read()):
            cause, facts = self.cause(failure)
            self.last = cause
            out.append((failure, cause, facts))
        return out

    def cause(self, failure: Failure) -> tuple[Cause, dict[str, Any]]:
        """Why ``failure``'s round failed (see the module docstring), and the facts to record."""
        errors = dict(failure.rank_errors)
        self._from_round(failure)
        rank, pid = self._ranks.get(failure.local_rank, (None, None))
        cause = self._rank_cause(failure.local_rank, failure.exitcode, errors, failure.unranked)
        facts: dict[str, Any] = {"exitcode": failure.exitcode, "local_rank": failure.local_rank, "rank": rank}
        if cause.echo:               # the named rank only saw a peer go: a rank here that failed on its own?
            for local, (other, other_pid) in sorted(self._ranks.items()):
                if local == failure.local_rank:
                    continue
                own = errors.get(other) if other is not None else None
                oom = self.oom.evidence(other_pid) if own is None else None
                first = (cause_of(node=self.node, exitcode=-signal.SIGKILL, rank=other, local_rank=local,
                                  pid=other_pid, oom=oom) if oom is not None
                         else self._rank_cause(local, 1, errors, None) if own is not None else None)
                if first is not None and not first.echo:
                    facts.update(local_rank=local, rank=other, exitcode=None if oom is None else -signal.SIGKILL,
                                 echo_of=cause.what)
                    cause = first
                    break
        facts.update(cause.to_dict())
        return cause, facts

    def _from_round(self, failure: Failure) -> None:
        """A failed worker the process table never showed (it died between two looks): its global
        rank from the round's group rank, as torchrun assigns it (group rank x nproc + local rank)."""
        if failure.local_rank in self._ranks or failure.group_rank is None or self.nproc_per_node is None:
            return
        self._ranks[failure.local_rank] = (failure.group_rank * self.nproc_per_node + failure.local_rank, failure.pid)

    def _rank_cause(self, local_rank: int, exitcode: int, errors: dict[int, str], unranked: str | None) -> Cause:
        rank, pid = self._ranks.get(local_rank, (None, None))
        own = errors.get(rank) if rank is not None else None
        if own is None and exitcode > 0 and not errors:
            own = unranked            # failed before its process group was up: no prefix, and no other rank's
        oom = self.oom.evidence(pid) if exitcode == -signal.SIGKILL and pid else None
        silent = None
        if own is not None and error_kind(own) == "collective_timeout":
            waiting = {r for r, e in errors.items() if error_kind(e) == "collective_timeout"}
            silent = sorted({r for r, _ in self._ranks.values() if r is not None} - waiting)
        return cause_of(node=self.node, exitcode=exitcode, rank=rank, local_rank=local_rank, pid=pid, error=own,
                        oom=oom, silent_ranks=silent)

    def last_reason(self) -> str | None:
        """The last failed round's cause as a line, else the last exception line seen at all."""
        return self.last.line if self.last is not None else self.scan.last_error

"""The agent's watch on its state dir's space: the I/O around ``state_dir``'s decisions.

Every tick the agent calls :meth:`StateDirWatch.tick`: one ``statvfs`` of the state dir and,
while it is full and room is seen, a probe write (at most every ``PROBE_EVERY_S``); writers in
the agent that find the disk full call :meth:`StateDirWatch.note` (torchrun's output relay
through the supervisor, ``pids.json``, ``lease.json``, the agent's own files). A change is
announced once:

* **full**: a ``state_dir_full`` event on each job the agent runs (``{path, free_bytes, error,
  where, effect}``), one warning log line, the node's record in etcd gains ``state_dir_full``
  (``marind status`` and ``marind doctor`` show it), the gauge ``marind_state_dir_full`` is 1;
  a job that would start here meanwhile is not started and gets the same event once
  (``action: "not started on this node"``);
* **recovered**: a ``state_dir_recovered`` event on the same jobs (``{path, free_bytes, full_s,
  dropped}``), one info line, the node's record loses ``state_dir_full``, the gauge is 0. The
  writes that were dropped are not made up for; they simply go on (the output relay writes
  again, with a marker line saying how much it dropped; the curves start a new event file).

Supervision never depends on any of it: a failed look or a failed probe is an observation,
never an exception out of the tick.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from marind.agent.link import Link
from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.state_dir import (
    EFFECT,
    Change,
    DirState,
    Look,
    Verdict,
    WriteFailed,
    admit,
    condition,
    decide,
    probe_due,
)
from marind.control.events import STATE_DIR_FULL, STATE_DIR_RECOVERED
from marind.core.disk import Space, error_text, free_space, is_disk_full
from marind.core.log import get_logger

#: bytes of the probe write (a page of most filesystems)
PROBE_BYTES = 4096


class StateDirWatch:
    """The state dir's space as this agent sees it, and what it tells of it.

    Args:
        state_dir: the agent's state dir.
        node: this node's name.
        metrics: the agent's metrics (``marind_state_dir_full``, ``marind_state_dir_free_bytes``).
        clock: wall-clock time.
    """

    def __init__(self, state_dir: str | Path, *, node: str, metrics: Metrics, clock=time.time):
        self.path = Path(state_dir)
        self.metrics, self.clock = metrics, clock
        self.state = DirState()
        self.log = get_logger(__name__, node=node)
        self._pending: list[tuple[Verdict, DirState]] = []   # changes not announced yet, with the state before
        self._told: set[str] = set()         # jobs told of the current episode
        self._held: set[str] = set()         # jobs not started here because of it

    @property
    def full(self) -> bool:
        """Whether the state dir counts as full now."""
        return self.state.full

    # -- what the agent's writers and loop call ---------------------------------------------
    def note(self, what: str, path: str | Path, exc: OSError) -> bool:
        """A write found its disk full: one observation (announced at the next tick).

        Args:
            what: what was being written ("torchrun output", "lease.json", ...).
            path: the file.
            exc: the write's error.

        Returns:
            True when it was a full disk (ENOSPC, EDQUOT) on the state dir's filesystem; False
            for any other error or another filesystem (a ``tensorboard_dir`` elsewhere): the
            caller says why itself.
        """
        if not is_disk_full(exc) or not self._same_filesystem(Path(path)):
            return False
        self._fold(decide(self.state, WriteFailed(what, str(path), error_text(exc)), self.clock()))
        return True

    def write_text(self, path: Path, text: str, what: str) -> bool:
        """Write one of the agent's own small files (``metrics.port``, ``etcd.endpoint``) through a temp
        file renamed over it; a full disk is noted and the file left as it was. Returns whether it was written."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if not self.note(what, path, exc):
                self.log.warning("state_file_failed", path=str(path), error=str(exc))
            return False

    def tick(self, now: float, jobs: Iterable[str], link: Link | None) -> None:
        """One look (and a probe when due); announce what changed; the gauges.

        Args:
            now: the current time.
            jobs: the jobs this agent runs.
            link: the agent's link (events, the node's record); None before it is connected.
        """
        space = self._look()
        probe = self._probe() if probe_due(self.state, space, now) else None
        self._fold(decide(self.state, Look(space, probe), now))
        running = list(jobs)
        for verdict, before in self._pending:
            self._announce(verdict, before, running, link, now)
        self._pending.clear()
        if self.state.full and link is not None:
            for job in running:              # a job that started as the disk filled
                if job not in self._told:
                    self._tell_full(job, link.outbox, {})
        self.metrics.set("marind_state_dir_full", 1 if self.state.full else 0)
        if self.state.free_bytes is not None:
            self.metrics.set("marind_state_dir_free_bytes", self.state.free_bytes)

    def may_start(self, job: str, outbox: Outbox) -> bool:
        """May ``job`` start here? Not while full: the job gets one event saying so, and starts once
        space is back (``state_dir.admit``)."""
        ok, why = admit(self.state, str(self.path))
        if not ok and job not in self._held:
            self._held.add(job)
            self.log.warning("job_not_started", job=job, reason=why)
            self._tell_full(job, outbox, {"action": "not started on this node until space comes back"})
        return ok

    # -- internals ---------------------------------------------------------------------------
    def _fold(self, verdict: Verdict) -> None:
        before, self.state = self.state, verdict.state
        if verdict.change != Change.NONE:
            self._pending.append((verdict, before))

    def _look(self) -> Space | None:
        try:
            return free_space(self.path)
        except OSError as exc:
            self.log.debug("state_dir_statvfs_failed", error=str(exc))
            return None

    def _probe(self) -> bool:
        probe = self.path / f".space-probe.{os.getpid()}"
        try:
            with open(probe, "wb") as fh:
                fh.write(b"\0" * PROBE_BYTES)
            return True
        except OSError:
            return False
        finally:
            try:
                probe.unlink()
            except OSError:
                pass

    def _same_filesystem(self, path: Path) -> bool:
        try:
            here = os.stat(self.path).st_dev
        except OSError:
            return True
        for p in (path, *path.parents):
            try:
                return os.stat(p).st_dev == here
            except OSError:
                continue
        return True

    def _detail(self) -> dict:
        s = self.state
        return {"path": str(self.path), "free_bytes": s.free_bytes, "error": s.error, "where": s.where,
                "effect": EFFECT}

    def _tell_full(self, job: str, outbox: Outbox, extra: dict) -> None:
        self._told.add(job)
        outbox.event(job, STATE_DIR_FULL, {**self._detail(), **extra})

    def _announce(self, verdict: Verdict, before: DirState, jobs: list[str], link: Link | None,
                  now: float) -> None:
        s = verdict.state
        if verdict.change == Change.FULL:
            self.log.warning("state_dir_full", path=str(self.path), reason=verdict.reason, free_bytes=s.free_bytes,
                             jobs=jobs, effect=EFFECT)
            self._told.clear()
            if link is not None:
                for job in jobs:
                    self._tell_full(job, link.outbox, {})
            self._publish(link, condition(s, str(self.path)))
            return
        full_s = None if before.since is None else round(now - before.since, 1)
        self.log.info("state_dir_recovered", path=str(self.path), free_bytes=s.free_bytes, full_s=full_s,
                      dropped=list(before.dropped))
        if link is not None:
            detail = {"path": str(self.path), "free_bytes": s.free_bytes, "full_s": full_s,
                      "dropped": list(before.dropped)}
            for job in sorted(self._told | self._held):
                link.outbox.event(job, STATE_DIR_RECOVERED, detail)
        self._told.clear()
        self._held.clear()
        self._publish(link, None)

    def _publish(self, link: Link | None, value: dict | None) -> None:
        if link is None:
            return
        registry = link.registry
        registry.set_condition("state_dir_full", value)
        link.outbox.put("", registry.publish)

"""Fencing: a node whose lease lapsed stops what ran under it, then registers anew.

First thing every tick the agent asks ``Fencing.tick``. A run whose node
lease must have expired (``ttl`` after its last successful renewal) while
its workers made no progress (``decisions.fence_due``) belongs to a world
the other nodes have replaced: its torchrun and workers are SIGKILLed at
once (no SIGTERM: nothing of that world may save a checkpoint), its queued
writes are dropped from the outbox, and nothing more is written for that
round. Workers that still step reach their peers (only etcd is away) and
train on. Once etcd answers after an expiry, the node registers anew
(``NodeRegistry.rejoin``: a new lease), writes ``host_fenced`` for each
fenced job, and the agent starts the job again, a ``node_rejoined`` event:
the node joins the job's next round.

A lease that etcd says is gone sooner than ``ttl`` after its last renewal was
revoked by the other agents, which declared this node lost while it was silent
(``marind.agent.liveness.silence``): every run is fenced then, whether its workers step
or not, before the node registers anew.

It also keeps each run's ``lease.json`` (``marind.core.lease_file``) at the
lease's last renewal + ``silent_window(ttl)``, so that a checkpoint commit can
refuse to run for a world that may have been replaced (or sooner, where the
data-network watch fences the run's commits: the ``commit_fence`` it is given).

A fence is the run's own (``RunMonitor.fence``); this module decides when, and
what is reported of it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from marind.agent.decisions import fence_due, stall_window
from marind.agent.link import Link
from marind.agent.run_monitor import RunMonitor
from marind.core.errors import ControlPlaneUnavailable
from marind.core.lease_file import lease_path, write_lease
from marind.core.log import get_logger


class Fencing:
    """This node's fenced runs, until it is registered again and runs each job anew.

    Args:
        link: the agent's link (registry, outbox, change watch).
        node: this node's name.
        commit_fence: where a run's commits are fenced by the data-network watch
            (``DataNetwork.commit_fence_at``; None: they are not).
        on_disk_full: told of a lease file that found the disk full (the state-dir watch says it
            once; True when it was that); any other failure is logged here.
    """

    def __init__(self, link: Link, node: str,
                 commit_fence: Callable[[RunMonitor], float | None] = lambda run: None,
                 on_disk_full: Callable[[str, Path, OSError], bool] = lambda what, path, exc: False) -> None:
        self.link = link
        self.commit_fence = commit_fence
        self.on_disk_full = on_disk_full
        self.fenced: dict[str, dict] = {}     # job -> what was fenced, until the job runs here again
        self._unreported: list[str] = []      # jobs whose host_fenced waits for the new registration
        self._lease_written = 0.0
        self._register_anew = False           # a declared-lost exit: a new lease even if the old lives
        self.node = node
        self.log = get_logger(__name__, node=node)

    def tick(self, runs: dict[str, RunMonitor], now: float) -> bool:
        """Fence the runs that must be; after an expiry, register anew.

        Args:
            runs: the agent's runs by job (fenced ones are removed).
            now: the current time.

        Returns:
            False while the node waits to register anew (no job may start meanwhile).
        """
        reg = self.link.registry
        expired, revoked = reg.expired, reg.expired and reg.revoked    # one look: the keep-alive thread moves them
        if reg.trusted_renewal != self._lease_written:
            self._write_lease_files(runs, reg.trusted_renewal, reg.ttl)
        for run in list(runs.values()):
            fence, why = fence_due(last_renewal=reg.last_renewal, ttl=reg.ttl, now=now,
                                   progress_at=run.progress_at, stall_s=stall_window(reg.ttl),
                                   revoked=revoked)
            written = run.progress_written_at() if fence else None
            if written is not None and written > (run.progress_at or 0.0):
                # progress_at dates from the agent's last look; with etcd silent (a cut link, not a
                # refused connection) that pass's etcd calls blocked for their timeouts: the workers'
                # own write times say whether they stepped since (frozen ones wrote nothing)
                fence, why = fence_due(last_renewal=reg.last_renewal, ttl=reg.ttl, now=now,
                                       progress_at=written, stall_s=stall_window(reg.ttl),
                                       revoked=revoked)
            if fence:
                self._fence(run, why, now, reg.last_renewal)
                runs.pop(run.job, None)
        if not (expired or self._unreported):
            return True
        try:
            anew = reg.rejoin(force=self._register_anew)
        except ControlPlaneUnavailable:
            return False
        self._register_anew = False
        self.log.info("node_rejoined", new_lease=anew, fenced=sorted(self.fenced))
        for job in self._unreported:
            self.link.outbox.event(job, "host_fenced", {**self.fenced[job], "new_lease": anew})
        self._unreported.clear()
        self.link.watch.poke()
        return True

    def _write_lease_files(self, runs: dict[str, RunMonitor], renewed_at: float, ttl: float) -> None:
        """Each run's ``lease.json``: how long its workers may still commit (``marind.core.lease_file``)."""
        for run in runs.values():
            try:
                write_lease(run.run_dir, renewed_at=renewed_at, ttl=ttl, node=self.node,
                            until=self.commit_fence(run))
            except OSError as exc:
                self._failed(run, exc)
        self._lease_written = renewed_at if runs else 0.0

    def _failed(self, run: RunMonitor, exc: OSError) -> None:
        if not self.on_disk_full("lease.json", lease_path(run.run_dir), exc):
            self.log.warning("lease_file_failed", job=run.job, error=str(exc))

    def started(self, run: RunMonitor) -> None:
        """A run just started: its lease file now (the next renewal rewrites it)."""
        reg = self.link.registry
        try:
            write_lease(run.run_dir, renewed_at=reg.trusted_renewal, ttl=reg.ttl, node=self.node)
        except OSError as exc:
            self._failed(run, exc)

    def rejoined(self, job: str) -> dict | None:
        """The job starts here again: what was fenced of it (None: it was not)."""
        return self.fenced.pop(job, None)

    def fence_replaced(self, run: RunMonitor, why: str, now: float) -> None:
        """Fence a run whose world the other agents replaced while this node's lease may still live.

        Two callers: a torchrun that exited because the others declared this node lost (its
        workers may have resumed before this agent looked, so the stall test of ``tick`` did
        not fence it), and a node that lost its data network (``marind.agent.liveness.data_watch``;
        the agent then holds the job until the data network answers). The same fence as a
        lapsed lease: what is left is killed, the queued writes are dropped, and the node
        registers anew (its incarnation is counted lost) before it runs the job again
        (``node_rejoined``).
        """
        self._fence(run, why, now, self.link.registry.last_renewal)
        self._register_anew = True

    def _fence(self, run: RunMonitor, why: str, now: float, last_renewal: float) -> None:
        self.log.warning("host_fenced", job=run.job, reason=why, round=run.generations, step=run.step)
        killed = run.fence()          # SIGKILL now, reap; torchft: its slot is not released
        dropped = self.link.outbox.drop_job(run.job)
        self.fenced[run.job] = {"reason": why, "fenced_at": now, "lease_renewed_at": last_renewal,
                                "round": run.generations, "step": run.step, "killed": len(killed),
                                "writes_dropped": dropped}
        self._unreported.append(run.job)


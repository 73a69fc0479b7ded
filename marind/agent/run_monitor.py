"""One supervised job on this node: its torchrun, rendezvous rounds, restarts, hangs, progress.

The agent keeps one ``RunMonitor`` per job it runs and calls
``supervise(now)`` every tick while torchrun lives. The monitor

* tells rendezvous rounds apart (a new set of worker launchers is a new
  round; after the first it is a restart) and moves the job's state
  (``WORKERS_STARTED``, ``RESTART``) through the outbox;
* follows ``logs/torchrun.log`` (``worker_errors.LogScan``): each round
  torchrun reports failed is a restart with its reason (the worker's last
  exception line), counted even when the workers died between two ticks,
  and the job's ``last_error``;
* reads the current round's progress records: the node's step, checkpoint
  commits (an event with their duration, and a metric) and the per-job metrics;
* acts on the loss of another node of the job (``act_on_losses``): a node
  whose lease expired while this node's workers stalled is marked lost for
  the rendezvous, and the agent that records the loss restarts its workers
  into a new round at once (``decisions.on_node_loss``); the others' torchruns
  follow when it waits for them in the rendezvous;
* detects hangs without blocking the tick: a hung round's workers get
  SIGUSR1 (faulthandler dumps their stacks into the log), and
  ``HANG_DUMP_WAIT_S`` later, on a later tick, SIGKILL; then the
  ``hang_detected`` event is written (``settle_hang`` does it at once when
  torchrun exits or the run is stopped meanwhile);
* builds this node's record of the job (``node_record``) and, where global
  rank 0 ran, the job's final progress (``final_progress``).

Decisions come from ``marind.agent.decisions``; writes go through the
``Outbox``. Exits, slots and etcd reads are the agent's (``daemon``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from marind.agent import progress as prog
from marind.agent.decisions import (
    HANG_DUMP_WAIT_S,
    Generation,
    HangAction,
    LossAction,
    classify_workers,
    failure_restarts,
    on_hang,
    on_node_loss,
    workers_running,
)
from marind.agent.ft_coordinator import FTCoordinator
from marind.agent.hang import HangDetector
from marind.agent.lifecycle import JobEvent
from marind.agent.membership import Loss, Membership
from marind.agent.outbox import Outbox
from marind.agent.registry import NodeRegistry
from marind.agent.supervisor import TorchrunSupervisor, WorkerProc
from marind.agent.worker_errors import Failure, LogScan, LogTail, read_error_file
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.core.spec import RunSpec
from marind.metrics import Metrics

if TYPE_CHECKING:
    from marind.agent.data_watch import DataWatch


@dataclass(frozen=True)
class PendingKill:
    """Hung workers whose stacks are being dumped; they are killed at ``kill_at``."""

    kill_at: float
    pids: tuple[int, ...]        # the workers signalled with SIGUSR1 (the ones to kill)
    dumped: list[int]            # those the signal reached
    why: str
    ranks: list[int]             # ranks of the progress records at detection


class RunMonitor:
    """This node's part of one job while its torchrun runs.

    Args:
        job: the job's id.
        spec: the job's spec.
        sup: the job's torchrun on this node (started).
        node: this node's name.
        outbox: where state changes and events go.
        metrics: the agent's metrics.
        members: the job's membership watch (``node_lost`` events).
        ft: torchft jobs: the node's replica-group slot and lighthouse.
        log_offset: the size of ``logs/torchrun.log`` before this torchrun started (earlier runs' output
            is not this run's).
    """

    def __init__(self, job: str, spec: RunSpec, sup: TorchrunSupervisor, *, node: str, outbox: Outbox,
                 metrics: Metrics, members: Membership | None = None, ft: FTCoordinator | None = None,
                 log_offset: int = 0):
        self.job, self.spec, self.sup, self.node = job, spec, sup, node
        self.outbox, self.metrics, self.members, self.ft = outbox, metrics, members, ft
        self.hang = HangDetector(spec.job.hang_timeout)
        self.gen_pids: frozenset[int] = frozenset()
        self.worker_pids: frozenset[int] = frozenset()   # the latest round's workers (their records count)
        self.generations = 0
        self.restarts = 0
        self.awaiting_running_since: float | None = None
        self.last_report = 0.0
        self.last_ckpt_step: int | None = None
        self.terminal_since: float | None = None
        self.step = 0
        self.pending_kill: PendingKill | None = None
        self.started_at = time.time()
        self.log_path = sup.run_dir / "logs" / "torchrun.log"
        self.tail = LogTail(self.log_path, log_offset)
        self.scan = LogScan()
        self._unmatched_failures = 0         # restarts counted from the log whose round was not seen yet
        self._ckpt_baseline = False          # the first training record's checkpoint step is a restore
        self._step_seen_at: dict[int, float] = {}   # rank 0's steps: when its record first showed them
        self.progress_at: float | None = None          # when the round's stall marker last changed
        self.progress_interval: float | None = None    # a typical time between two changes (moving average)
        self._marker: object = None
        self.pending_losses: dict[str, Loss] = {}       # lost nodes not acted on yet
        self._waiting_logged: set[str] = set()
        self.data: DataWatch | None = None              # the data-network watch (``data_watch``)
        self.log = get_logger(__name__, node=node, job=job)

    @property
    def nproc(self) -> int:
        """Slots the job holds on this node."""
        return self.spec.job.nproc_per_node

    # -- one tick -------------------------------------------------------------------------
    def supervise(self, now: float) -> list[prog.ProgressRecord]:
        """Rounds, progress, checkpoints and hangs of one tick (torchrun is running).

        Args:
            now: the current time.

        Returns:
            The current round's progress records (for the report).
        """
        self.scan_log(now)
        workers = self.sup.workers()
        launched = frozenset(w.launched_by for w in workers)   # stable while a round lives
        verdict, self.gen_pids, _ = classify_workers(launched, self.gen_pids)
        if verdict == Generation.NEW:
            self._new_generation(now)
        if workers:     # every worker of the round seen so far: one may exit before another is seen
            pids = frozenset(w.pid for w in workers)
            self.worker_pids = pids if verdict == Generation.NEW else self.worker_pids | pids
        records = prog.current(prog.read_records(self.sup.run_dir), {w.pid for w in workers})
        if self.awaiting_running_since is not None:
            running, _ = workers_running((r.phase for r in records), awaiting_since=self.awaiting_running_since,
                                         now=now)
            if running:
                self.awaiting_running_since = None
                self.outbox.state(self.job, JobEvent.WORKERS_STARTED,
                                  reason=f"workers running (round {self.generations})")
        self._watch_checkpoints(records, now)
        marker = prog.stall_marker(records)
        if marker is not None and marker != self._marker:
            if self.progress_at is not None:
                dt, prev = now - self.progress_at, self.progress_interval
                self.progress_interval = dt if prev is None else 0.7 * prev + 0.3 * dt
            self._marker, self.progress_at = marker, now
        self.step = prog.node_step(records) or self.step
        self._job_metrics(records)
        self._hang_tick(now, workers, records)
        return records

    def progress_written_at(self) -> float | None:
        """When this round's workers last wrote a progress record (their clock); None without one."""
        records = prog.current(prog.read_records(self.sup.run_dir), {w.pid for w in self.sup.workers()})
        return max((r.updated_at for r in records), default=None)

    def _new_generation(self, now: float) -> None:
        self.generations += 1
        self.hang.reset()
        self._marker, self.progress_at, self.progress_interval = None, None, None
        self.metrics.inc("marind_rendezvous_rounds_total")
        if self._unmatched_failures or self.generations == 1:
            # the round after the latest failure counted from the log (rounds between were missed)
            if self._unmatched_failures:
                self.awaiting_running_since = now
            else:
                self.outbox.state(self.job, JobEvent.WORKERS_STARTED, reason=f"workers started on {self.node}")
            self._unmatched_failures = 0
            return
        self.awaiting_running_since = now
        self._restarted("a new rendezvous round: the job's nodes changed or another node's workers failed",
                        {"round": self.generations})

    def _restarted(self, reason: str, detail: dict) -> None:
        self.restarts += 1
        self.metrics.inc("marind_restarts_total")
        self.log.info("workers_restarted", round=self.generations, restarts=self.restarts, reason=reason)
        self.outbox.state(self.job, JobEvent.RESTART, reason=f"workers restarted on {self.node}: {reason}",
                          restarts=self.restarts)
        self.outbox.event(self.job, "restart", {**detail, "restarts": self.restarts, "reason": reason})

    # -- the log: failed rounds and their reasons -----------------------------------------
    def scan_log(self, now: float) -> list[Failure]:
        """Read what torchrun.log gained; each failed round is a restart (or the last failure).

        A failure torchrun restarts after (the first ``max_restarts``) counts as a restart at
        once, with the worker's error line as its reason; every failure becomes the job's
        ``last_error``.

        Args:
            now: the current time.

        Returns:
            The failures found.
        """
        found = self.scan.feed(self.tail.read())
        for failure in found:
            self.outbox.last_error(self.job, self._error_record(failure.reason, "log", now,
                                                                exitcode=failure.exitcode))
            restart, _ = failure_restarts(len(self.scan.failures), self.spec.job.max_restarts)
            if restart:
                self._unmatched_failures += 1
                self._restarted(failure.reason, {"round": self.generations + self._unmatched_failures,
                                                 "exitcode": failure.exitcode, "local_rank": failure.local_rank})
                self.awaiting_running_since = now
        return found

    def exit_reason(self, now: float) -> str | None:
        """torchrun exited: why its workers failed, if this node knows (error file, else the log).

        Also records it as the job's ``last_error`` when it comes from the error file.

        Args:
            now: the current time.

        Returns:
            The error line, or None when no worker failed here.
        """
        self.scan_log(now)
        line = read_error_file(self.sup.run_dir / "logs" / "error.json", self.started_at)
        if line is not None:
            self.outbox.last_error(self.job, self._error_record(line, "error_file", now))
            return line
        return self.scan.failures[-1].reason if self.scan.failures else self.scan.last_error

    def _error_record(self, line: str, source: str, now: float, **extra) -> dict:
        return {"line": line, "node": self.node, "at": now, "source": source, "restarts": self.restarts, **extra}

    # -- progress: checkpoints and the per-job metrics ------------------------------------
    def _watch_checkpoints(self, records: list[prog.ProgressRecord], now: float) -> None:
        rank0 = next((r for r in records if r.rank == 0), None)
        if rank0 is None or rank0.phase in ("starting", "restoring"):
            return
        self._step_seen_at.setdefault(rank0.step, rank0.updated_at)
        step = rank0.last_checkpoint_step
        if not self._ckpt_baseline:          # what the run restored, not a commit
            self._ckpt_baseline, self.last_ckpt_step = True, step
            return
        if step is None or (self.last_ckpt_step is not None and step <= self.last_ckpt_step):
            return
        started = min((t for s, t in self._step_seen_at.items() if s >= step), default=None)
        detail: dict[str, Any] = {"step": step}
        if started is not None and rank0.updated_at >= started:
            detail["duration_s"] = round(rank0.updated_at - started, 3)
            self.metrics.observe("marind_checkpoint_duration_seconds", detail["duration_s"], job=self.job)
        self.outbox.event(self.job, "checkpoint_committed", detail)
        self.last_ckpt_step = step
        self._step_seen_at = {s: t for s, t in self._step_seen_at.items() if s > step}

    def _job_metrics(self, records: list[prog.ProgressRecord]) -> None:
        rank0 = next((r for r in records if r.rank == 0), None)
        m, job = self.metrics, self.job
        m.set("marind_job_step", rank0.step if rank0 is not None else self.step, job=job)
        m.set("marind_job_restarts_total", self.restarts, job=job)
        if rank0 is not None and rank0.loss is not None:
            m.set("marind_job_loss", rank0.loss, job=job)
        if rank0 is not None and rank0.tokens_per_s is not None:
            m.set("marind_job_tokens_per_second", rank0.tokens_per_s, job=job)
        if self.last_ckpt_step is not None:
            m.set("marind_job_last_checkpoint_step", self.last_ckpt_step, job=job)

    # -- hangs ----------------------------------------------------------------------------
    def _hang_tick(self, now: float, workers: list[WorkerProc], records: list[prog.ProgressRecord]) -> None:
        hung, why = False, ""
        if self.pending_kill is None:
            if not workers or prog.all_done(records):
                return
            self.hang.observe(now, prog.stall_marker(records))
            hung, why = self.hang.check(now)
        self._hang_act(now, hung, why, records, torchrun_exited=False)

    def settle_hang(self, now: float) -> None:
        """torchrun exited or the run is being stopped: a pending kill happens now."""
        if self.pending_kill is not None:
            self._hang_act(now, False, "", [], torchrun_exited=True)

    def _hang_act(self, now: float, hung: bool, why: str, records: list[prog.ProgressRecord], *,
                  torchrun_exited: bool) -> None:
        pending = self.pending_kill
        action, _ = on_hang(now=now, hung=hung, why=why, kill_at=pending.kill_at if pending else None,
                            torchrun_exited=torchrun_exited)
        if action == HangAction.DUMP:
            self.log.warning("hang_detected", reason=why)
            self.metrics.inc("marind_hangs_total")
            pids = tuple(self.sup.worker_pids())
            dumped = self.sup.signal_workers(signal.SIGUSR1, pids)    # faulthandler: stacks into the log
            self.pending_kill = PendingKill(now + HANG_DUMP_WAIT_S, pids, dumped, why, [r.rank for r in records])
        elif action == HangAction.KILL and pending is not None:
            killed = self.sup.signal_workers(signal.SIGKILL, pending.pids)
            self.outbox.event(self.job, "hang_detected", {"reason": pending.why, "ranks": pending.ranks,
                                                          "stack_dumped": pending.dumped, "killed": killed,
                                                          "stack_dump": str(self.log_path)})
            self.pending_kill = None
            self.hang.reset()

    # -- records --------------------------------------------------------------------------
    def node_record(self, now: float, host: str) -> dict:
        """This node's record of the job (``{p}/jobs/{job}/nodes/{node}``).

        Args:
            now: the current time.
            host: this node's address.

        Returns:
            The record as written to etcd.
        """
        workers = [{"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid} for w in self.sup.workers()]
        state = "running" if workers else ("starting" if self.generations == 0 else "restarting")
        record: dict[str, Any] = {"state": state, "torchrun_pid": self.sup.pid, "workers": workers, "restarts": self.restarts,
                  "step": self.step, "updated_at": now, "host": host,
                  "agent_pid": os.getpid(), "node": self.node, "round": self.generations}
        if self.members is not None and self.members.incarnation != str(os.getpid()):
            record["incarnation"] = self.members.incarnation      # registered anew after a fence
        if self.ft is not None:
            record["ft"] = self.ft.report()
        if self.data is not None:
            record["data"] = self.data.record_part(now)
        return record

    def report(self, client: EtcdClient, registry: NodeRegistry, now: float,
               records: list[prog.ProgressRecord] | None = None) -> bool:
        """Write this node's record (under the node's lease), the job's progress where global
        rank 0 runs here, and a ``node_lost`` event for each node this agent is first to miss.

        Args:
            client: the etcd client.
            registry: this node's registration (its lease and host).
            now: the current time.
            records: the current round's progress records.

        Returns:
            False when etcd was unreachable.
        """
        self.last_report = now
        record = self.node_record(now, str(registry.record["host"]))
        try:
            client.put_json(client.key("jobs", self.job, "nodes", self.node), record, lease=registry.lease)
            summary = prog.job_summary(records or [])
            if summary is not None:
                client.put_json(client.key("jobs", self.job, "progress"), summary)
            for loss in self.members.poll() if self.members is not None else ():
                self.log.warning("node_gone", lost=loss.node, cause=loss.cause, in_round=loss.in_round)
                self.pending_losses[loss.node] = loss
        except ControlPlaneUnavailable:
            return False
        return True

    # -- other nodes lost ---------------------------------------------------------------------
    def act_on_losses(self, now: float, stall_s: float) -> None:
        """Decide on each lost node not acted on yet (``decisions.on_node_loss``) and act.

        Acting: mark it lost for the rendezvous, record the loss once (``node_lost``, by the
        agent whose claim wins) and, where that agent's decision is a restart, SIGKILL its
        workers: torchrun restarts them into a new round without the lost node, and the
        other nodes' torchruns follow when they see it waiting in the rendezvous.

        Args:
            now: the current time.
            stall_s: the stall that counts as stuck (``decisions.stall_window``).

        Raises:
            ControlPlaneUnavailable: etcd unreachable (the rest waits for the next tick).
        """
        members = self.members
        if members is None:
            return
        for node, loss in list(self.pending_losses.items()):
            if self.data is not None and (node, loss.incarnation) in self.data.acted:
                del self.pending_losses[node]      # declared lost already (silent host, data network gone)
                continue
            if members.present(loss):
                self.log.info("node_back", node=node, reason="its record is back: it was never gone")
                del self.pending_losses[node]
                continue
            desc = members.rdzv_desc(loss)
            action, why = on_node_loss(in_round=members.in_current_round(loss, desc),
                                       workers_running=bool(self.sup.worker_pids()),
                                       progress_at=self.progress_at, now=now, stall_s=stall_s,
                                       torchft=self.ft is not None)
            if action == LossAction.WAIT:
                if node not in self._waiting_logged:
                    self._waiting_logged.add(node)
                    self.log.warning("node_lost_waiting", node=node, cause=loss.cause, reason=why)
                continue
            members.mark_lost(loss, desc)
            first = members.claim(loss, {"action": action.value})
            del self.pending_losses[node]
            self._waiting_logged.discard(node)
            self.log.warning("node_lost", lost=node, cause=loss.cause, action=action.value, reason=why,
                             recorded=first, rdzv_node=desc)
            if not first:
                continue
            killed: list[int] = []
            if action == LossAction.RESTART:
                killed = self.kill_workers()
            self.outbox.event(self.job, "node_lost", {"node": node, "cause": loss.cause, "action": action.value,
                                                      "reason": why, "killed": killed})

    def kill_workers(self) -> list[int]:
        """SIGKILL this node's workers (and their zygote stubs): torchrun starts a new round."""
        procs = self.sup.workers()
        pids = {w.pid for w in procs} | {w.launched_by for w in procs}
        return self.sup.signal_workers(signal.SIGKILL, sorted(pids))

    def final_progress(self) -> None:
        """Where global rank 0 ran: queue the job's progress with the last steps since the previous report.

        Everywhere: ``step`` becomes the last step this node's workers reached.
        """
        # only the last round's records: a rank file left by an earlier round (when this node
        # held global rank 0) would set the job's progress back
        records = prog.read_records(self.sup.run_dir)
        final = prog.current(records, set(self.worker_pids))
        self.step = max(self.step, prog.node_step(final))
        summary = prog.job_summary(final)
        self.log.info("final_progress", step=summary and summary["step"],
                      workers=sorted(self.worker_pids), records={r.rank: r.pid for r in records})
        if summary is not None:
            self.step = max(self.step, summary["step"])
            self.outbox.progress(self.job, summary)

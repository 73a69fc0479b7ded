"""One supervised job on this node: its torchrun, rendezvous rounds, restarts, hangs, progress.

The agent keeps one ``RunMonitor`` per job it runs and calls
``supervise(now)`` every tick while torchrun lives. The monitor

* tells rendezvous rounds apart (a new set of worker launchers is a new
  round; after the first it is a restart) and moves the job's state
  (``WORKERS_STARTED``, ``RESTART``) through the outbox;
* follows ``logs/torchrun.log`` (``failure_watch``): each failed round is a restart with
  its cause (the first failed rank's, in words: ``failure_causes``) and the ``last_error``;
* reads the current round's progress records (``run_progress``): the node's
  step, when the round last moved, checkpoint commits (an event with their
  duration, and a metric) and the per-job metrics;
* acts on the loss of another node of the job (``act_on_losses``, ``node_losses``):
  a node whose lease expired while this node's workers stalled is marked lost
  for the rendezvous, and the agent that records the loss restarts its workers
  into a new round at once; one the data-network watch declared already
  (``note_member_lost``) is not acted on again;
* detects hangs without blocking the tick (``hang_kill``): a hung round's
  workers' stacks are dumped (SIGUSR1), then, on a later tick, they are killed
  and ``hang_detected`` written (at once by ``settle_hang`` when torchrun exits
  or the run is stopped meanwhile);
* builds this node's record of the job (``node_record``; the agent adds the
  data network's row) and, where global rank 0 ran, the job's final progress
  (``final_progress``).

The monitor owns its state. The agent (``daemon``), fencing and the data-network
watch (``marind.agent.liveness``) call its methods (``stop``, ``fence``,
``on_terminal_state``, ``note_member_lost``, ...) and read only the properties
the class lists; this module imports none of them.

Decisions come from ``marind.agent.decisions``; writes go through the
``Outbox``. Exits, slots and etcd reads are the agent's (``daemon``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from marind.agent import progress as prog
from marind.agent.decisions import (
    Generation,
    TerminalDecision,
    classify_workers,
    failure_restarts,
    on_terminal_state,
    workers_running,
)
from marind.agent.failure_watch import FailureWatch
from marind.agent.ft.coordinator import FTCoordinator
from marind.agent.hang_kill import HangKiller, PendingKill
from marind.agent.job_journal import JobJournal
from marind.agent.membership import Loss, Membership, report_record
from marind.agent.metrics import Metrics
from marind.agent.node_losses import NodeLosses
from marind.agent.outbox import Outbox
from marind.agent.registry import NodeRegistry
from marind.agent.run_history import RunHistory
from marind.agent.run_progress import RunProgress
from marind.agent.supervisor import TorchrunSupervisor
from marind.agent.worker_errors import Failure, read_error_file
from marind.control.lifecycle import JobEvent, JobState
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.core.spec import RunSpec


class RunMonitor:
    """This node's part of one job while its torchrun runs.

    What others read of it (read-only properties): ``job``, ``node``, ``spec``, ``nproc``,
    ``members``, ``ft``, ``run_dir``, ``torchrun_pid``, ``stopping``, ``generations``,
    ``restarts``, ``step``, ``progress_at``, ``progress_interval``, ``last_report`` and
    ``terminal_since``; its tests also read ``pending_kill`` and ``awaiting_running_since``.
    Everything else, and every change, goes through its methods.

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
        self._job, self._spec, self._sup, self._node = job, spec, sup, node
        self._outbox, self._metrics, self._members, self._ft = outbox, metrics, members, ft
        self._gen_pids: frozenset[int] = frozenset()
        self._worker_pids: frozenset[int] = frozenset()   # the latest round's workers (their records count)
        self._generations = 0
        self._restarts = 0
        self._awaiting_running_since: float | None = None
        self._last_report = 0.0
        self._terminal_since: float | None = None
        self._started_at = time.time()
        log_path = sup.run_dir / "logs" / "torchrun.log"
        self._fails = FailureWatch(node, sup.run_dir, log_offset, nproc_per_node=spec.job.nproc_per_node)
        self._unmatched_failures = 0         # restarts counted from the log whose round was not seen yet
        self.log = get_logger(__name__, node=node, job=job)
        self._losses = NodeLosses(job, members, outbox, self.log) if members is not None else None
        self._progress = RunProgress(job, outbox, metrics, RunHistory(job, spec, sup.run_dir, node=node, outbox=outbox,
                                                                      log=self.log))
        self._journal = JobJournal(job, metrics)
        self._hangs = HangKiller(job, sup, hang_timeout=spec.job.hang_timeout, outbox=outbox, metrics=metrics,
                                 log=self.log, log_path=log_path)

    # -- what others read -----------------------------------------------------------------
    @property
    def job(self) -> str:
        """The job's id."""
        return self._job

    @property
    def node(self) -> str:
        """This node's name."""
        return self._node

    @property
    def spec(self) -> RunSpec:
        """The job's spec."""
        return self._spec

    @property
    def nproc(self) -> int:
        """Slots the job holds on this node."""
        return self._spec.job.nproc_per_node

    @property
    def members(self) -> Membership | None:
        """The job's membership watch (None without one)."""
        return self._members

    @property
    def ft(self) -> FTCoordinator | None:
        """torchft jobs: the node's replica-group slot and lighthouse (None for elastic jobs)."""
        return self._ft

    @property
    def run_dir(self) -> Path:
        """The job's run dir on this node."""
        return self._sup.run_dir

    @property
    def torchrun_pid(self) -> int | None:
        """torchrun's pid."""
        return self._sup.pid

    @property
    def stopping(self) -> bool:
        """The agent is stopping (or has stopped) this torchrun."""
        return self._sup.stopping

    @property
    def generations(self) -> int:
        """Rendezvous rounds seen so far."""
        return self._generations

    @property
    def restarts(self) -> int:
        """Restarts of the job's workers counted on this node."""
        return self._restarts

    @property
    def step(self) -> int:
        """The furthest step this node's workers reached."""
        return self._progress.step

    @property
    def progress_at(self) -> float | None:
        """When the round's workers last made progress (None: not seen in this round)."""
        return self._progress.progress_at

    @property
    def progress_interval(self) -> float | None:
        """A typical time between two changes of the round's progress (None: not known yet)."""
        return self._progress.progress_interval

    @property
    def last_report(self) -> float:
        """When this node's record was last written (``report``)."""
        return self._last_report

    @property
    def terminal_since(self) -> float | None:
        """When the agent first saw the job SUCCEEDED while this torchrun ran (``on_terminal_state``)."""
        return self._terminal_since

    @property
    def pending_kill(self) -> PendingKill | None:
        """Hung workers whose stacks are being dumped (None: none)."""
        return self._hangs.pending

    @property
    def awaiting_running_since(self) -> float | None:
        """Since when a restarted round is awaited to run (None: not waiting)."""
        return self._awaiting_running_since

    # -- one tick -------------------------------------------------------------------------
    def supervise(self, now: float) -> list[prog.ProgressRecord]:
        """Rounds, progress, checkpoints and hangs of one tick (torchrun is running).

        Args:
            now: the current time.

        Returns:
            The current round's progress records (for the report).
        """
        self.scan_log(now)
        workers = self._sup.workers()
        self._fails.note(workers)
        launched = frozenset(w.launched_by for w in workers)   # stable while a round lives
        verdict, self._gen_pids, _ = classify_workers(launched, self._gen_pids)
        if verdict == Generation.NEW:
            self._new_generation(now)
        if workers:     # every worker of the round seen so far: one may exit before another is seen
            pids = frozenset(w.pid for w in workers)
            self._worker_pids = pids if verdict == Generation.NEW else self._worker_pids | pids
        records = prog.current(prog.read_records(self._sup.run_dir), {w.pid for w in workers})
        if self._awaiting_running_since is not None:
            running, _ = workers_running((r.phase for r in records), awaiting_since=self._awaiting_running_since,
                                         now=now)
            if running:
                self._awaiting_running_since = None
                self._outbox.state(self.job, JobEvent.WORKERS_STARTED,
                                   reason=f"workers running (round {self._generations})")
        self._progress.observe(records, now, restarts=self._restarts)
        self._hangs.tick(now, workers, records)
        return records

    def progress_written_at(self) -> float | None:
        """When this round's workers last wrote a progress record (their clock); None without one."""
        records = prog.current(prog.read_records(self._sup.run_dir), {w.pid for w in self._sup.workers()})
        return max((r.updated_at for r in records), default=None)

    def _new_generation(self, now: float) -> None:
        self._generations += 1
        self._hangs.new_round()
        self._progress.new_round()
        self._metrics.inc("marind_rendezvous_rounds_total")
        if self._unmatched_failures or self._generations == 1:
            # the round after the latest failure counted from the log (rounds between were missed)
            if self._unmatched_failures:
                self._awaiting_running_since = now
            else:
                self._outbox.state(self.job, JobEvent.WORKERS_STARTED, reason=f"workers started on {self.node}")
            self._unmatched_failures = 0
            return
        self._awaiting_running_since = now
        self._restarted("a new rendezvous round: the job's nodes changed or another node's workers failed",
                        {"round": self._generations})

    def _restarted(self, reason: str, detail: dict) -> None:
        self._restarts += 1
        self._metrics.inc("marind_restarts_total")
        self.log.info("workers_restarted", round=self._generations, restarts=self._restarts, reason=reason)
        self._outbox.state(self.job, JobEvent.RESTART, reason=f"workers restarted on {self.node}: {reason}",
                           restarts=self._restarts)
        self._outbox.event(self.job, "restart", {**detail, "restarts": self._restarts, "reason": reason})

    # -- the log: failed rounds and their reasons -----------------------------------------
    def scan_log(self, now: float) -> list[Failure]:
        """Read what torchrun.log gained; each failed round is a restart (or the last failure).

        A failure torchrun restarts after (the first ``max_restarts``) counts as a restart at once,
        its cause (``failure_watch``) its reason; every failure becomes the job's ``last_error``.

        Args:
            now: the current time.

        Returns:
            The failures found.
        """
        found = self._fails.read()
        for _, cause, facts in found:
            self._outbox.last_error(self.job, self._error_record(cause.line, "log", now, **facts))
            restart, _ = failure_restarts(len(self._fails.scan.failures), self.spec.job.max_restarts)
            if restart:
                self._unmatched_failures += 1
                self._restarted(cause.line, {"round": self._generations + self._unmatched_failures, **facts})
                self._awaiting_running_since = now
        return [failure for failure, _, _ in found]

    def exit_reason(self, now: float) -> str | None:
        """torchrun exited: why its workers failed, if this node knows (error file, else the log).

        Also records it as the job's ``last_error`` when it comes from the error file.

        Args:
            now: the current time.

        Returns:
            The error line, or None when no worker failed here.
        """
        self.scan_log(now)
        line = read_error_file(self._sup.run_dir / "logs" / "error.json", self._started_at)
        if line is not None:
            self._outbox.last_error(self.job, self._error_record(line, "error_file", now))
            return line
        return self._fails.last_reason()

    def _error_record(self, line: str, source: str, now: float, **extra) -> dict:
        return {"line": line, "node": self.node, "at": now, "source": source, "restarts": self._restarts, **extra}

    def settle_hang(self, now: float) -> None:
        """torchrun exited or the run is being stopped: a pending kill happens now."""
        self._hangs.settle(now)

    # -- records --------------------------------------------------------------------------
    def node_record(self, now: float, host: str) -> dict:
        """This node's record of the job (``{p}/jobs/{job}/nodes/{node}``).

        Args:
            now: the current time.
            host: this node's address.

        Returns:
            The record as written to etcd.
        """
        workers = [{"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid} for w in self._sup.workers()]
        state = "running" if workers else ("starting" if self._generations == 0 else "restarting")
        record: dict[str, Any] = {"state": state, "torchrun_pid": self._sup.pid, "workers": workers,
                                  "restarts": self._restarts, "step": self.step, "updated_at": now, "host": host,
                                  "agent_pid": os.getpid(), "node": self.node, "round": self._generations}
        if self._members is not None and self._members.incarnation != str(os.getpid()):
            record["incarnation"] = self._members.incarnation      # registered anew after a fence
        if self._ft is not None:
            record["ft"] = self._ft.report()
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
        self._last_report = now
        record = self.node_record(now, str(registry.record["host"]))
        try:
            report_record(client, self.job, self.node, record, registry.lease, self._members)   # + the peers' records
            self._journal.report(client, records or [], now)    # progress, series, ledger where rank 0 runs
            if self._losses is not None:
                self._losses.poll()
        except ControlPlaneUnavailable:
            return False
        return True

    # -- other nodes lost ---------------------------------------------------------------------
    def act_on_losses(self, now: float, stall_s: float) -> None:
        """Decide on each lost node not acted on yet (``decisions.on_node_loss``) and act (``node_losses``):
        mark it lost for the rendezvous, record the loss once (``node_lost``) and, where this agent's
        claim won and the decision is a restart, SIGKILL this node's workers (a new round without it).

        Args:
            now: the current time.
            stall_s: the stall that counts as stuck (``decisions.stall_window``).

        Raises:
            ControlPlaneUnavailable: etcd unreachable (the rest waits for the next tick).
        """
        if self._losses is not None:
            self._losses.act(now, stall_s, workers_running=self.has_workers, progress_at=self.progress_at,
                             torchft=self._ft is not None, kill_workers=self.kill_workers)

    def note_member_lost(self, loss: Loss) -> None:
        """Another watch (the data network's) declared ``loss`` lost and acted on it: this run does not."""
        if self._losses is not None:
            self._losses.note_declared(loss)

    def has_workers(self) -> bool:
        """Whether this node's workers were running when last looked at."""
        return bool(self._sup.worker_pids())

    def kill_workers(self) -> list[int]:
        """SIGKILL this node's workers (and their zygote stubs): torchrun starts a new round."""
        procs = self._sup.workers()
        pids = {w.pid for w in procs} | {w.launched_by for w in procs}
        return self._sup.signal_workers(signal.SIGKILL, sorted(pids))

    # -- the run's end ------------------------------------------------------------------------
    def exited(self) -> int | None:
        """torchrun's exit code once it exited by itself; None while it runs or while the agent stops it."""
        rc = self._sup.poll()
        return rc if rc is not None and not self._sup.stopping else None

    def on_terminal_state(self, state: JobState, now: float) -> TerminalDecision:
        """The job is terminal in etcd while this node runs it: end the run now, or give its torchrun
        time to finish (``decisions.on_terminal_state``; since when is kept: ``terminal_since``)."""
        decision = on_terminal_state(state, torchrun_running=self._sup.poll() is None,
                                     terminal_since=self._terminal_since, now=now)
        self._terminal_since = decision.terminal_since
        return decision

    def declared_lost(self) -> bool:
        """Elastic jobs: whether the other agents declared this torchrun lost (raises ControlPlaneUnavailable)."""
        if self._members is None or self._ft is not None:
            return False
        return self._members.declared_lost(self._sup.pid)

    def stop(self, timeout: float) -> None:
        """Stop torchrun and the workers (SIGTERM, SIGKILL after ``timeout``), reap them, clear ``pids.json``;
        the run's curves get their last points; the membership's watch ends."""
        self._sup.stop(timeout)
        self._progress.close()
        if self._members is not None:
            self._members.close()

    def fence(self) -> list[int]:
        """Kill everything of this run now (``TorchrunSupervisor.kill_now``: no SIGTERM, nothing may save),
        with no ``hang_detected`` for a pending kill; a torchft coordinator stops without releasing its slot.

        Returns:
            The pids signalled.
        """
        killed = self._sup.kill_now()
        self._hangs.drop_pending()
        self.stop(1)                    # reap and clear pids.json (everything is dead already); close the curves
        if self._ft is not None:
            self._ft.stop(release=False)
        return killed

    def final_progress(self) -> None:
        """Where global rank 0 ran: queue the job's progress with the last steps since the previous report.

        Everywhere: ``step`` becomes the last step this node's workers reached.
        """
        summary = self._progress.final(self._sup.run_dir, self._worker_pids, self.log)
        self._outbox.put(self.job, lambda: self._journal.flush(self._outbox.client))    # the last points
        if summary is not None:
            self._outbox.progress(self.job, summary)

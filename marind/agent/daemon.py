"""The agent's main loop: register, reconcile jobs, supervise torchruns, report.

Which jobs a node takes part in (kept simple on purpose): every
non-terminal job, oldest first, as long as the sum of the jobs'
``nproc_per_node`` fits in the node's ``slots`` (``decisions.admit``).
Elasticity within ``job.nodes = "min:max"`` is torchrun's: a node beyond
``max`` waits in the rendezvous for a later round.

Each tick (every ``TICK_S``) the loop reads the jobs from etcd (skipped
while etcd is away: supervision goes on and state changes wait in the
``Outbox`` until etcd returns), starts/stops torchruns, lets each job's
``RunMonitor`` watch its workers (rounds, restarts, hangs, checkpoints),
decides what a torchrun exit means (``decisions.after_exit``), and every
``report_interval`` writes the node's per-job record and, where global
rank 0 lives, the job's progress.

Node loss: each run acts on the loss of another node of its job
(``RunMonitor.act_on_losses``); and first thing every tick, ``Fencing`` stops
the runs whose node lease must have expired (``marind.agent.liveness.fencing``).
A full state dir (``state_dir_watch``) starts no job here; the running ones go on.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from marind.agent import progress as prog
from marind.agent.agent_stop import stop_agent
from marind.agent.decisions import Admission, ExitAction, admit, after_exit, replica_group_lost, stall_window
from marind.agent.doctor_probe import DoctorProbes
from marind.agent.etcd_compaction import Compactor
from marind.agent.ft.exits import group_failure_leaves, leave_replica_group
from marind.agent.job_trust import JobTrust
from marind.agent.launch import launch
from marind.agent.link import Link
from marind.agent.liveness.data_watch import DataNetwork
from marind.agent.liveness.fencing import Fencing
from marind.agent.metrics import Metrics, MetricsServer
from marind.agent.page.server import JobPages, page_token
from marind.agent.run_monitor import RunMonitor
from marind.agent.sdnotify import Notifier, watchdog_interval
from marind.agent.state_dir_watch import StateDirWatch
from marind.agent.stragglers import excluded_here
from marind.agent.supervisor import reap_leftovers
from marind.control.config import AgentConfig, endpoint_file
from marind.control.job_records import JobView, list_job_ids, read_job
from marind.control.lifecycle import JobEvent
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger

if TYPE_CHECKING:
    from marind.control.local_etcd import LocalEtcd

TICK_S = 0.5


class Agent:
    """`marind agent`: one per node.

    Args:
        config: the agent's settings.
        notifier: systemd notifications (a no-op outside systemd).
        metrics: the agent's Prometheus metrics.
    """

    def __init__(self, config: AgentConfig, *, notifier: Notifier | None = None,
                 metrics: Metrics | None = None):
        self.config = config
        self.node = config.node
        self.notifier = notifier or Notifier()
        self.metrics = metrics or Metrics()
        self.log = get_logger(__name__, node=self.node)
        self.stop_event = threading.Event()
        self.runs: dict[str, RunMonitor] = {}
        self.finished: set[str] = set()      # jobs this agent is done with (terminal, or ran to an end here)
        self._warned: set[tuple[str, str]] = set()     # (what, job) logged once
        self.link: Link | None = None
        self.doctor: DoctorProbes | None = None      # `marind doctor --cluster` probes
        self.data: DataNetwork | None = None         # probes of the peers' data endpoints
        self.etcd_server: LocalEtcd | None = None
        self.metrics_server: MetricsServer | None = None
        self.endpoint, self.etcd_ok = config.etcd, False
        self.slots = config.effective_slots()
        self._watchdog_every, self._last_watchdog = watchdog_interval(), 0.0
        self._last_nodes_count = 0.0
        self._cp_restarts: dict[str, int] = {}
        self._fencing: Fencing | None = None
        self.trust = JobTrust.from_config(config)     # [agent] require_signed_jobs, trusted_keys
        self.disk = StateDirWatch(config.state_dir, node=self.node, metrics=self.metrics)   # a full state dir
        self.compactor = Compactor(config.etcd_compact_interval)     # etcd's history kept bounded

    @property
    def jobs_dir(self) -> Path:
        """``{state_dir}/jobs``: the jobs' run dirs."""
        return Path(self.config.state_dir) / "jobs"

    @property
    def fencing(self) -> Fencing:
        """Fencing of this node's runs after its lease lapsed (made with the link)."""
        if self._fencing is None:
            self._fencing = Fencing(self._link(), self.node, commit_fence=self._commit_fence, on_disk_full=self.disk.note)
        return self._fencing

    def _commit_fence(self, run: RunMonitor) -> float | None:
        return self.data.commit_fence_at(run) if self.data is not None else None

    def _link(self) -> Link:
        if self.link is None:
            raise RuntimeError("the agent is not connected to etcd yet")
        return self.link

    def _offline(self) -> None:
        self.etcd_ok = False

    # -- lifecycle ----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop (then ``shutdown`` stops the jobs)."""
        def handler(signum, _frame):
            self.log.info("stop_requested", signal=signal.Signals(signum).name)
            self.stop_event.set()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        """Run until stopped; returns the process exit code (0)."""
        self.jobs_dir.mkdir(parents=True, exist_ok=True)          # and the state dir
        reaped = reap_leftovers(self.jobs_dir)
        if reaped:
            self.log.warning("reaped_leftovers", pids=reaped,
                             reason="processes of a previous agent; the job restarts them here")
        if self.config.metrics_port:
            port = 0 if self.config.metrics_port < 0 else self.config.metrics_port
            pages = JobPages(lambda: self.link.client if self.link else None,
                             page_token(self.config.metrics_host, self.config.state_dir))
            self.metrics_server = MetricsServer(self.metrics, self.config.metrics_host, port,
                                                healthy=self._health, pages=pages).start()
            self.disk.write_text(self.disk.path / "metrics.port", str(self.metrics_server.port), "metrics.port")
            self.log.info("metrics_listening", url=f"http://{self.config.metrics_host}:{self.metrics_server.port}/metrics")
        try:
            if self.config.embedded:
                from marind.agent.embedded_etcd import start_embedded_etcd
                self.etcd_server, self.endpoint = start_embedded_etcd(self.config.state_dir)
            if not self._connect():
                return 0
            if self.etcd_server is None and not self.config.embedded:
                # the CLI on this host finds the agent's etcd here (`--state-dir`, MARIND_STATE_DIR)
                self.disk.write_text(endpoint_file(self.config.state_dir), self.endpoint + "\n", "etcd.endpoint")
            self.notifier.ready(f"node {self.node} registered; etcd {self.endpoint}")
            self.log.info("agent_ready", etcd=self.endpoint, slots=self.slots, state_dir=str(self.config.state_dir))
            while not self.stop_event.is_set():
                self.tick()
                self.stop_event.wait(TICK_S)
        finally:
            self.shutdown()
        return 0

    def _connect(self) -> bool:
        self.link = Link.open(self.config, self.endpoint, slots=self.slots, online=lambda: self.etcd_ok,
                              offline=self._offline, on_keepalive_failure=self._keepalive_failed)
        self.doctor = DoctorProbes(self.link.client, self.config, self.endpoint)
        self.data = DataNetwork(self.node, self.link.outbox, self.link.registry, fresh_s=self.config.lease_ttl)
        registry = self.link.registry
        last_log = 0.0
        while not self.stop_event.is_set():
            try:
                registry.register()
                registry.start()
                self.etcd_ok = True
                return True
            except ControlPlaneUnavailable as exc:
                if time.monotonic() - last_log > 10:
                    self.log.warning("waiting_for_etcd", error=str(exc))
                    self.notifier.status(f"waiting for etcd at {self.endpoint}")
                    last_log = time.monotonic()
                self.stop_event.wait(1.0)
        return False

    def _keepalive_failed(self) -> None:
        self.metrics.inc("marind_etcd_keepalive_failures_total")

    def _health(self) -> tuple[bool, str]:
        ok = self.etcd_ok and (self.link is None or self.link.registry.connected)
        return ok, f"{'ok' if ok else 'etcd unreachable'}; {len(self.runs)} job(s) on node {self.node}"

    def shutdown(self) -> None:
        """Stop every job's torchrun (in parallel), leave the jobs cleanly, deregister (``agent_stop``)."""
        stop_agent(self)

    # -- one tick -----------------------------------------------------------------------------
    def tick(self) -> None:
        """One pass: etcd's jobs, each run's supervision, the outbox, metrics, the watchdog."""
        link = self._link()
        now = time.time()
        if self.etcd_server is not None and not self.etcd_server.running:
            self.log.warning("embedded_etcd_died", action="restart")
            try:
                self.etcd_server.start()
            except Exception as exc:  # noqa: BLE001 - retried next tick
                self.log.error("embedded_etcd_restart_failed", error=str(exc))
        registered = self.fencing.tick(self.runs, now)
        self.etcd_ok = self.etcd_ok and registered
        views = None
        try:
            if registered and (not self.etcd_ok or link.watch.due()):
                link.watch.begin_read()
                views = self._read_jobs(link.client)
                self.etcd_ok = True
            if now - self._last_nodes_count >= max(self.config.report_interval, link.watch.resync_s):
                self.metrics.set("marind_nodes", link.client.count_prefix(link.client.key("nodes") + "/"))
                self._last_nodes_count = now
        except ControlPlaneUnavailable as exc:
            if self.etcd_ok:
                self.log.warning("etcd_unreachable", error=str(exc), action="supervising on")
            self.etcd_ok = False
            link.watch.poke()
        self.metrics.set("marind_etcd_up", 1 if self.etcd_ok else 0)
        if views is not None:
            for view in views:
                self._reconcile(view, now)
                if self._waiting_on(view):
                    link.watch.poke()    # slots, a torchft slot, a grace period: look again next tick
        for run in list(self.runs.values()):
            self._supervise(run, now)
        self.disk.tick(now, self.runs, link)      # the state dir's space: announced once per change
        if self.etcd_ok:
            link.outbox.flush()
            if self.doctor is not None:
                self.doctor.tick()
            self.compactor.tick(link.client, now)
        self.metrics.set("marind_jobs", len(self.runs))
        if self._watchdog_every is not None and time.monotonic() - self._last_watchdog >= self._watchdog_every:
            self.notifier.watchdog()
            self._last_watchdog = time.monotonic()

    def _read_jobs(self, client: EtcdClient) -> list[JobView]:
        views = []
        for job in list_job_ids(client):
            if job in self.finished and job not in self.runs:
                continue
            views.append(read_job(client, job))
        return sorted(views, key=lambda v: (v.submitted_rev, v.id))

    def _reconcile(self, view: JobView, now: float) -> None:
        run = self.runs.get(view.id)
        state = view.state.state
        if state.is_terminal():
            if run is None:
                self.finished.add(view.id)
                self._link().ft_pending.drop(view.id)
                return
            decision = run.on_terminal_state(state, now)
            if decision.end:
                self._end_run(run, decision.reason)
            return
        if view.cancel:
            self._link().outbox.state(view.id, JobEvent.CANCEL, reason=f"cancelled by {view.cancel.get('by', '?')}")
            if run is not None:
                self._end_run(run, "cancelled")
            return
        if run is None and view.id in self.finished:
            return
        excluded = excluded_here(self._link().client, view, self.node)      # [fault] straggler_action
        if excluded is not None:
            if run is not None:
                self._end_run(run, f"excluded as a straggler: {excluded.get('reason', '')}")
                self._link().outbox.event(view.id, "node_left", {"reason": "excluded as a straggler",
                                                                 "by": excluded.get("by")})
            self.finished.add(view.id)
        elif run is None:
            self._maybe_start(view)

    def _waiting_on(self, view: JobView) -> bool:
        """Does this node still have to act on ``view`` on a later tick?"""
        run = self.runs.get(view.id)
        if run is None:
            return view.id not in self.finished and not view.state.state.is_terminal()
        return run.terminal_since is not None

    def _first(self, what: str, job: str) -> bool:
        """True the first time ``what`` happens to ``job`` (log it once)."""
        if (what, job) in self._warned:
            return False
        self._warned.add((what, job))
        return True

    def _maybe_start(self, view: JobView) -> None:
        link = self._link()
        spec = view.run_spec
        if spec is None:
            if self._first("job_spec_invalid", view.id):
                self.log.error("job_spec_invalid", job=view.id, error=view.spec_error, action="job fails")
            self.finished.add(view.id)
            link.outbox.state(view.id, JobEvent.FAILED, reason=f"the stored spec is not valid: {view.spec_error}")
            return
        if not self.trust.admits(view, link):     # not signed by a trusted key (refused), or not read yet
            return
        verdict, _ = admit(spec.job.nproc_per_node, sum(r.nproc for r in self.runs.values()), self.slots)
        if verdict == Admission.TOO_BIG:
            if self._first("job_too_big", view.id):
                self.log.warning("job_too_big", job=view.id, nproc_per_node=spec.job.nproc_per_node, slots=self.slots)
        if verdict != Admission.START or (self.data is not None and not self.data.may_start(view.id, self.runs)) \
                or not self.disk.may_start(view.id, link.outbox):     # a full state dir: not until space is back
            return
        run_dir = self.jobs_dir / view.id
        ready, ft = link.ft_pending.ready(view.id, spec, run_dir)
        if not ready:
            return
        run = launch(view.id, spec, run_dir=run_dir, config=self.config, endpoint=self.endpoint, node=self.node,
                     ft=ft, client=link.client, outbox=link.outbox, metrics=self.metrics,
                     registration=link.registry.generation, on_disk_full=self.disk.note)
        if run is None:          # the state dir filled as it started (noted: the next tick says so)
            return
        self.runs[view.id] = run
        self.fencing.started(run)
        fenced = self.fencing.rejoined(view.id)    # back after a fence: the job grows back
        kind, extra = ("node_rejoined", {"fenced_at": fenced["fenced_at"]}) if fenced else ("node_joined", {})
        link.outbox.event(view.id, kind, {"torchrun_pid": run.torchrun_pid, "slots": self.slots, **extra})
        self._report(run, time.time(), force=True)

    def _end_run(self, run: RunMonitor, why: str) -> None:
        link = self._link()
        self.log.info("job_stopping", job=run.job, reason=why)
        run.settle_hang(time.time())
        run.stop(self.config.stop_timeout)
        run.final_progress()
        if run.ft is not None:
            run.ft.stop()
        self.runs.pop(run.job, None)
        self.metrics.remove_job(run.job)
        self.finished.add(run.job)
        link.watch.poke()         # slots are free again
        link.outbox.leaving(run.job, run.members, why)
        link.outbox.drop_node_record(run.job)

    # -- supervision of one job ---------------------------------------------------------------
    def _supervise(self, run: RunMonitor, now: float) -> None:
        if run.ft is not None and self.etcd_ok:
            try:
                run.ft.tick()
            except ControlPlaneUnavailable:
                self.etcd_ok = False
            except Exception as exc:  # noqa: BLE001 - e.g. a lighthouse that would not start; next tick
                self.log.error("ft_tick_failed", job=run.job, error=f"{type(exc).__name__}: {exc}")
            lost, why = replica_group_lost(run.ft.slot, run.ft.launched_slot, stopping=run.stopping)
            if lost:
                leave_replica_group(run, run.ft, why, link=self._link(), runs=self.runs, stop_timeout=self.config.stop_timeout, log=self.log)
                return
        rc = run.exited()
        if rc is not None:
            run.settle_hang(now)
            self._torchrun_exited(run, rc)
            return
        records = run.supervise(now)
        if now - run.last_report >= self.config.report_interval:
            self._report(run, now, records=records)
        stall_s = stall_window(self._link().registry.ttl)
        try:
            if self.etcd_ok:              # a no-op without a pending loss
                run.act_on_losses(now, stall_s)
            if self.data is not None:     # the commit fence always; the verdict with etcd
                self.data.tick(run, now, stall_s=stall_s, fence=self.fencing.fence_replaced, runs=self.runs,
                               online=self.etcd_ok)
        except ControlPlaneUnavailable:
            self.etcd_ok = False

    def _control_plane_down(self) -> bool:
        try:
            self._link().client.ping()
            return False
        except ControlPlaneUnavailable:
            self.etcd_ok = False
            return True

    def _declared_lost(self, run: RunMonitor) -> bool:
        try:
            return run.declared_lost()
        except ControlPlaneUnavailable:
            self.etcd_ok = False
            return False

    def _torchrun_exited(self, run: RunMonitor, rc: int) -> None:
        link = self._link()
        self.runs.pop(run.job, None)
        self.metrics.remove_job(run.job)
        link.watch.poke()
        run.stop(5)   # reap anything left, clear pids.json
        if run.ft is not None:
            run.ft.stop()
        etcd_down = rc != 0 and self._control_plane_down()
        if rc != 0 and not etcd_down and self._declared_lost(run):
            # back from a freeze: the others replaced this node's world before its agent looked
            reason = f"torchrun exited {rc}: the other agents declared this node lost while it was away"
            self.fencing.fence_replaced(run, reason, time.time())
            return
        limit = run.spec.job.max_restarts
        decision = after_exit(rc, node=self.node, job=run.job, etcd_down=etcd_down,
                              etcd_retries=self._cp_restarts.get(run.job, 0), max_restarts=limit)
        if etcd_down:
            self._cp_restarts[run.job] = decision.etcd_retries
            self.log.warning("torchrun_lost_etcd", job=run.job, rc=rc, attempt=decision.etcd_retries, limit=limit)
        if decision.action == ExitAction.RETRY:
            link.outbox.event(run.job, "restart", {"reason": decision.reason, "rc": rc,
                                                   "restarts": run.restarts})
            return
        self.finished.add(run.job)
        if decision.action == ExitAction.FAIL and run.ft is not None and group_failure_leaves(run, run.ft, rc, link=self._link(), node=self.node, log=self.log):
            return
        event, kind = ((JobEvent.SUCCEEDED, "succeeded") if decision.action == ExitAction.SUCCEED
                       else (JobEvent.FAILED, "failed"))
        self.log.info("torchrun_exited", job=run.job, rc=rc)
        run.final_progress()
        why = run.exit_reason(time.time()) if rc != 0 else None
        # the event first: whoever sees the terminal state (`events -f`, `submit --wait`) finds it written
        link.outbox.event(run.job, kind, {"rc": rc, "step": run.step, "restarts": run.restarts}
                          | ({"reason": why} if why else {}))
        link.outbox.state(run.job, event, reason=decision.reason, restarts=run.restarts, step=run.step or None)
        link.outbox.leaving(run.job, run.members, f"torchrun exited {rc}")
        link.outbox.drop_node_record(run.job)

    def _report(self, run: RunMonitor, now: float, records: list[prog.ProgressRecord] | None = None,
                force: bool = False) -> None:
        if not self.etcd_ok and not force:
            return
        link = self._link()
        if not run.report(link.client, link.registry, now, records):
            self.etcd_ok = False

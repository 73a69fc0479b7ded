"""The agent's main loop: register, reconcile jobs, supervise torchruns, report.

Which jobs a node takes part in (kept simple on purpose): every
non-terminal job, oldest first, as long as the sum of the jobs'
``nproc_per_node`` fits in the node's ``slots``. Elasticity within
``job.nodes = "min:max"`` is torchrun's: a node beyond ``max`` waits in
the rendezvous for a later round.

Each tick (every ``TICK_S``) the loop reads the jobs from etcd (skipped
while etcd is away: supervision goes on and state changes wait in an
outbox until etcd returns), starts/stops torchruns, watches their
workers (a new set of worker pids is a new rendezvous round; after the
first it is a restart), runs hang detection, and every
``report_interval`` writes the node's per-job record and, where global
rank 0 lives, the job's progress.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from marind.agent import progress as prog
from marind.agent.config import AgentConfig, endpoint_file
from marind.agent.events import append_event
from marind.agent.hang import HangDetector
from marind.agent.job_records import JobView, job_nodes, list_job_ids, read_job, update_state
from marind.agent.lifecycle import JobEvent, JobState
from marind.agent.change_watch import ChangeWatch
from marind.agent.ft_coordinator import FTCoordinator, is_torchft
from marind.agent.membership import Membership
from marind.agent.registry import NodeRegistry
from marind.agent.supervisor import (
    TorchrunSupervisor,
    default_python,
    prepare_run_dir,
    reap_leftovers,
    torchrun_command,
    worker_env,
)
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.metrics import Metrics, MetricsServer
from marind.sdnotify import Notifier, watchdog_interval

TICK_S = 0.5
SUCCESS_GRACE_S = 30.0      # a job SUCCEEDED elsewhere: let this node's torchrun finish too
RESTART_RUNNING_FALLBACK_S = 10.0
HANG_DUMP_WAIT_S = 2.0


@dataclass
class JobRun:
    job: str
    spec: dict
    sup: TorchrunSupervisor
    hang: HangDetector
    gen_pids: frozenset = frozenset()
    worker_pids: frozenset = frozenset()     # the latest generation's workers (their progress records count)
    generations: int = 0
    restarts: int = 0
    awaiting_running_since: float | None = None
    last_report: float = 0.0
    ckpt_since: float | None = None
    last_ckpt_step: int | None = None
    terminal_since: float | None = None
    members: Membership | None = None
    step: int = 0
    ft: FTCoordinator | None = None      # torchft jobs: replica-group slot and lighthouse

    @property
    def nproc(self) -> int:
        return int(self.spec.get("job", {}).get("nproc_per_node", 1))


class Agent:
    def __init__(self, config: AgentConfig, *, notifier: Notifier | None = None,
                 metrics: Metrics | None = None):
        self.config = config
        self.node = config.node
        self.notifier = notifier or Notifier()
        self.metrics = metrics or Metrics()
        self.log = get_logger(__name__, node=self.node)
        self.stop_event = threading.Event()
        self.runs: dict[str, JobRun] = {}
        self.finished: set[str] = set()      # jobs this agent is done with (terminal, or ran to an end here)
        self._outbox: list[tuple[str, Callable[[], None]]] = []
        self._warned_too_big: set[str] = set()
        self.client: EtcdClient | None = None
        self.jobwatch: ChangeWatch | None = None
        self.registry: NodeRegistry | None = None
        self.etcd_server = None
        self.metrics_server: MetricsServer | None = None
        self.endpoint = config.etcd
        self.etcd_ok = False
        self.slots = config.effective_slots()
        self._watchdog_every = watchdog_interval()
        self._last_watchdog = 0.0
        self._last_nodes_count = 0.0
        self._cp_restarts: dict[str, int] = {}
        self._ft_pending: dict[str, FTCoordinator] = {}
        self._ft_warned: set[str] = set()

    @property
    def jobs_dir(self) -> Path:
        return Path(self.config.state_dir) / "jobs"

    # -- lifecycle ----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self.log.info("stop_requested", signal=signal.Signals(signum).name)
            self.stop_event.set()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        Path(self.config.state_dir).mkdir(parents=True, exist_ok=True)
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        reaped = reap_leftovers(self.jobs_dir)
        if reaped:
            self.log.warning("reaped_leftovers", pids=reaped,
                             reason="processes of a previous agent; the job restarts them here")
        if self.config.metrics_port:
            port = 0 if self.config.metrics_port < 0 else self.config.metrics_port
            self.metrics_server = MetricsServer(self.metrics, self.config.metrics_host, port,
                                                healthy=self._health).start()
            (Path(self.config.state_dir) / "metrics.port").write_text(str(self.metrics_server.port))
            self.log.info("metrics_listening", url=f"http://{self.config.metrics_host}:{self.metrics_server.port}/metrics")
        try:
            if self.config.embedded:
                self._start_embedded_etcd()
            if not self._connect():
                return 0
            self.notifier.ready(f"node {self.node} registered; etcd {self.endpoint}")
            self.log.info("agent_ready", etcd=self.endpoint, slots=self.slots, state_dir=str(self.config.state_dir))
            while not self.stop_event.is_set():
                self.tick()
                self.stop_event.wait(TICK_S)
        finally:
            self.shutdown()
        return 0

    def _start_embedded_etcd(self) -> None:
        from marind.core.netutil import free_ports
        from marind.local_etcd import LocalEtcd

        base = Path(self.config.state_dir) / "etcd"
        base.mkdir(parents=True, exist_ok=True)
        ports_file = base / "ports.json"
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, ValueError):
            ports = dict(zip(("client", "peer"), free_ports(2)))
            ports_file.write_text(json.dumps(ports))
        self.etcd_server = LocalEtcd(base / "data", client_port=ports["client"], peer_port=ports["peer"],
                                     log_path=base / "etcd.log")
        from marind.core.netutil import port_open
        if port_open("127.0.0.1", ports["client"]):
            self.log.info("embedded_etcd_adopted", endpoint=self.etcd_server.endpoint)
            self.etcd_server = None   # left by a previous agent; use it as it is
            self.endpoint = f"http://127.0.0.1:{ports['client']}"
        else:
            self.etcd_server.start()
            self.endpoint = self.etcd_server.endpoint
        endpoint_file(self.config.state_dir).write_text(self.endpoint + "\n")

    def _connect(self) -> bool:
        c = self.config
        self.client = EtcdClient(self.endpoint, prefix=c.prefix, user=c.etcd_user,
                                 password=c.etcd_password, tls=c.tls)
        self.jobwatch = ChangeWatch(self.client)
        self.registry = NodeRegistry(self.client, self.node, slots=self.slots, labels=dict(c.labels),
                                     ttl=c.lease_ttl, on_keepalive_failure=self._keepalive_failed)
        last_log = 0.0
        while not self.stop_event.is_set():
            try:
                self.registry.register()
                self.registry.start()
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
        ok = self.etcd_ok and (self.registry is None or self.registry.connected)
        return ok, f"{'ok' if ok else 'etcd unreachable'}; {len(self.runs)} job(s) on node {self.node}"

    def shutdown(self) -> None:
        self.notifier.stopping(f"stopping {len(self.runs)} job(s)")
        threads = [threading.Thread(target=run.sup.stop, args=(self.config.stop_timeout,))
                   for run in self.runs.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.config.stop_timeout + 15)
        for job, run in list(self.runs.items()):
            if run.ft is not None:
                run.ft.stop()
            self._leave(run, "agent stopping")
            self._emit(job, "node_left", {"reason": "agent stopping"})
        self.runs.clear()
        self._flush_outbox()
        if self.jobwatch is not None:
            self.jobwatch.stop()
        if self.registry is not None:
            self.registry.stop(revoke=True)
        if self.client is not None:
            self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.etcd_server is not None:
            self.etcd_server.stop()
        self.log.info("agent_stopped")

    # -- one tick -----------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.time()
        if self.etcd_server is not None and not self.etcd_server.running:
            self.log.warning("embedded_etcd_died", action="restart")
            try:
                self.etcd_server.start()
            except Exception as exc:  # noqa: BLE001 - retried next tick
                self.log.error("embedded_etcd_restart_failed", error=str(exc))
        views = None
        try:
            if not self.etcd_ok or self.jobwatch.due():
                self.jobwatch.begin_read()
                views = self._read_jobs()
                self.etcd_ok = True
            if now - self._last_nodes_count >= self.config.report_interval:
                self.metrics.set("marind_nodes", self.client.count_prefix(self.client.key("nodes") + "/"))
                self._last_nodes_count = now
        except ControlPlaneUnavailable as exc:
            if self.etcd_ok:
                self.log.warning("etcd_unreachable", error=str(exc), action="supervising on")
            self.etcd_ok = False
            self.jobwatch.poke()
        self.metrics.set("marind_etcd_up", 1 if self.etcd_ok else 0)
        if views is not None:
            for view in views:
                self._reconcile(view, now)
                if self._waiting_on(view):
                    self.jobwatch.poke()    # slots, a torchft slot, a grace period: look again next tick
        for run in list(self.runs.values()):
            self._supervise(run, now)
        if self.etcd_ok:
            self._flush_outbox()
        self.metrics.set("marind_jobs", len(self.runs))
        if self._watchdog_every is not None and time.monotonic() - self._last_watchdog >= self._watchdog_every:
            self.notifier.watchdog()
            self._last_watchdog = time.monotonic()

    def _read_jobs(self) -> list[JobView]:
        views = []
        for job in list_job_ids(self.client):
            if job in self.finished and job not in self.runs:
                continue
            views.append(read_job(self.client, job))
        return sorted(views, key=lambda v: (v.submitted_rev, v.id))

    def _reconcile(self, view: JobView, now: float) -> None:
        run = self.runs.get(view.id)
        state = view.state.state
        if state.is_terminal():
            if run is None:
                self.finished.add(view.id)
                pending = self._ft_pending.pop(view.id, None)
                if pending is not None:
                    pending.stop()
                return
            if state == JobState.SUCCEEDED and run.sup.poll() is None:
                run.terminal_since = run.terminal_since or now
                if now - run.terminal_since < SUCCESS_GRACE_S:
                    return
            self._end_run(run, f"job is {state.value}")
            return
        if view.cancel:
            by = view.cancel.get("by", "?")
            self._queue(view.id, lambda: update_state(self.client, view.id, JobEvent.CANCEL,
                                                      reason=f"cancelled by {by}"))
            if run is not None:
                self._end_run(run, "cancelled")
            return
        if run is None and view.id not in self.finished:
            self._maybe_start(view)

    def _waiting_on(self, view: JobView) -> bool:
        """Does this node still have to act on ``view`` on a later tick?"""
        run = self.runs.get(view.id)
        if run is None:
            return view.id not in self.finished and not view.state.state.is_terminal()
        return run.terminal_since is not None

    def _maybe_start(self, view: JobView) -> None:
        used = sum(r.nproc for r in self.runs.values())
        if view.nproc_per_node > self.slots:
            if view.id not in self._warned_too_big:
                self.log.warning("job_too_big", job=view.id, nproc_per_node=view.nproc_per_node, slots=self.slots)
                self._warned_too_big.add(view.id)
            return
        if used + view.nproc_per_node > self.slots:
            return
        run_dir = self.jobs_dir / view.id
        ft = self._ft_ready(view, run_dir)
        if ft is False:
            return
        run_toml = prepare_run_dir(run_dir, view.spec)
        c = self.config
        cmd = torchrun_command(python=c.python or default_python(), job=view.id, spec=view.spec,
                               endpoint=self.endpoint, prefix=c.prefix, run_toml=run_toml,
                               rdzv_conf=c.rdzv_conf, replica_group=ft.slot if ft else None)
        env = worker_env(os.environ, job=view.id, node=self.node, run_dir=run_dir, spec=view.spec,
                         etcd_user=c.etcd_user, etcd_password=c.etcd_password)
        if ft is not None:
            env.update(ft.worker_env())
            ft.launched_slot = ft.slot
        sup = TorchrunSupervisor(view.id, run_dir, cmd, env)
        sup.start()
        hang_timeout = float(view.spec.get("job", {}).get("hang_timeout", 300.0))
        run = JobRun(view.id, view.spec, sup, HangDetector(hang_timeout), ft=ft)
        run.members = Membership(self.client, view.id, self.node, incarnation=str(os.getpid()))
        self.runs[view.id] = run
        self._emit(view.id, "node_joined", {"torchrun_pid": sup.pid, "slots": self.slots})
        self._report(run, time.time(), force=True)

    def _end_run(self, run: JobRun, why: str) -> None:
        self.log.info("job_stopping", job=run.job, reason=why)
        run.sup.stop(self.config.stop_timeout)
        self._final_progress(run)
        if run.ft is not None:
            run.ft.stop()
        self.runs.pop(run.job, None)
        self.finished.add(run.job)
        self.jobwatch.poke()         # slots are free again
        self._leave(run, why)
        key = self.client.key("jobs", run.job, "nodes", self.node)
        self._queue(run.job, lambda: self.client.delete(key))

    def _final_progress(self, run: JobRun) -> None:
        """Where global rank 0 ran: the job's progress with the last steps since the previous report.

        Everywhere: ``run.step`` becomes the last step this node's workers reached.
        """
        # only the last generation's records: a rank file left by an earlier generation (when this
        # node held global rank 0) would set the job's progress back
        records = prog.read_records(run.sup.run_dir)
        final = prog.current(records, set(run.worker_pids))
        run.step = max(run.step, prog.node_step(final))
        summary = prog.job_summary(final)
        self.log.info("final_progress", job=run.job, step=summary and summary["step"],
                      workers=sorted(run.worker_pids), records={r.rank: r.pid for r in records})
        if summary is not None:
            run.step = max(run.step, summary["step"])
            key = self.client.key("jobs", run.job, "progress")
            self._queue(run.job, lambda: self.client.put_json(key, summary))

    def _leave(self, run: JobRun, why: str) -> None:
        """Mark this node's departure as clean before its record goes (no node_lost for it)."""
        if run.members is not None:
            self._queue(run.job, lambda: run.members.leaving(why))

    # -- supervision of one job ---------------------------------------------------------------
    def _ft_ready(self, view: JobView, run_dir: Path):
        """torchft job: its coordinator once it has a slot and a lighthouse; False: not yet; None: not torchft."""
        if not is_torchft(view.spec):
            return None
        ft = self._ft_pending.get(view.id)
        if ft is None:
            ft = self._ft_pending[view.id] = FTCoordinator(
                self.client, view.id, self.node, self.registry.record["host"], view.spec, run_dir,
                lease=lambda: self.registry.lease)
        try:
            ft.tick()
        except ControlPlaneUnavailable:
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. torchft not installed here; retried next tick
            if view.id not in self._ft_warned:
                self.log.error("ft_not_ready", job=view.id, error=f"{type(exc).__name__}: {exc}")
                self._ft_warned.add(view.id)
            return False
        if not ft.ready:
            return False
        return self._ft_pending.pop(view.id)

    def _supervise(self, run: JobRun, now: float) -> None:
        if run.ft is not None and self.etcd_ok:
            try:
                run.ft.tick()
            except ControlPlaneUnavailable:
                self.etcd_ok = False
            except Exception as exc:  # noqa: BLE001 - e.g. a lighthouse that would not start; next tick
                self.log.error("ft_tick_failed", job=run.job, error=f"{type(exc).__name__}: {exc}")
            if run.ft.slot != run.ft.launched_slot and not run.sup.stopping:
                self._leave_replica_group(run)
                return
        rc = run.sup.poll()
        if rc is not None and not run.sup.stopping:
            self._torchrun_exited(run, rc)
            return
        workers = run.sup.workers()
        launched = frozenset(w.launched_by for w in workers)   # stable while a generation lives
        if launched and not launched <= run.gen_pids:
            if not run.gen_pids or launched.isdisjoint(run.gen_pids):
                self._new_generation(run, now)
                run.gen_pids = launched
            else:
                run.gen_pids = run.gen_pids | launched   # workers of this round still spawning
        if workers:
            run.worker_pids = frozenset(w.pid for w in workers)
        records = prog.current(prog.read_records(run.sup.run_dir), {w.pid for w in workers})
        if run.awaiting_running_since is not None and (
                any(r.phase in ("training", "checkpointing", "done") for r in records)
                or now - run.awaiting_running_since > RESTART_RUNNING_FALLBACK_S):
            run.awaiting_running_since = None
            self._queue(run.job, lambda: update_state(self.client, run.job, JobEvent.WORKERS_STARTED,
                                                      reason=f"workers running (round {run.generations})"))
        self._watch_checkpoints(run, records, now)
        run.step = prog.node_step(records) or run.step
        if workers and not prog.all_done(records):
            run.hang.observe(now, prog.stall_marker(records))
            hung, why = run.hang.check(now)
            if hung:
                self._handle_hang(run, records, why)
        if now - run.last_report >= self.config.report_interval:
            self._report(run, now, records=records)

    def _new_generation(self, run: JobRun, now: float) -> None:
        run.generations += 1
        run.hang.reset()
        self.metrics.inc("marind_rendezvous_rounds_total")
        if run.generations == 1:
            self._queue(run.job, lambda: update_state(self.client, run.job, JobEvent.WORKERS_STARTED,
                                                      reason=f"workers started on {self.node}"))
            return
        run.restarts += 1
        restarts = run.restarts
        self.metrics.inc("marind_restarts_total")
        self.log.info("workers_restarted", job=run.job, round=run.generations, restarts=restarts)
        self._queue(run.job, lambda: update_state(self.client, run.job, JobEvent.RESTART,
                                                  reason=f"torchrun restarted workers on {self.node}",
                                                  restarts=restarts))
        self._emit(run.job, "restart", {"round": run.generations, "restarts": restarts})
        run.awaiting_running_since = now

    def _control_plane_down(self) -> bool:
        try:
            self.client.ping()
            return False
        except ControlPlaneUnavailable:
            self.etcd_ok = False
            return True

    def _leave_replica_group(self, run: JobRun) -> None:
        """Our replica-group slot went (the lease lapsed while etcd was away, and another node took
        it): the workers belong to a group we are no longer in. Stop them; the job starts again
        here once the coordinator holds a slot (it keeps running for the lighthouse meanwhile)."""
        ft = run.ft
        self.log.warning("ft_group_changed", job=run.job, was=ft.launched_slot, now=ft.slot)
        run.sup.stop(self.config.stop_timeout)
        self.runs.pop(run.job, None)
        self._ft_pending[run.job] = ft
        self.jobwatch.poke()
        self._emit(run.job, "restart", {"reason": f"replica group slot {ft.launched_slot} lost; "
                                                  f"now {ft.slot if ft.slot is not None else 'none'}"})

    def _torchrun_exited(self, run: JobRun, rc: int) -> None:
        self.runs.pop(run.job, None)
        self.jobwatch.poke()
        run.sup.stop(5)   # reap anything left, clear pids.json
        if run.ft is not None:
            run.ft.stop()
        if rc != 0 and self._control_plane_down():
            # torchrun's rendezvous lost etcd: not the job's failure. Start it again once etcd is
            # back (the job resumes from its latest checkpoint), at most max_restarts times.
            tries = self._cp_restarts.get(run.job, 0) + 1
            self._cp_restarts[run.job] = tries
            limit = int(run.spec.get("job", {}).get("max_restarts", 3))
            self.log.warning("torchrun_lost_etcd", job=run.job, rc=rc, attempt=tries, limit=limit)
            if tries <= limit:
                self._emit(run.job, "restart", {"reason": "etcd unreachable: torchrun exited", "rc": rc})
                return
        self.finished.add(run.job)
        if rc != 0 and run.ft is not None and self._ft_others_train_on(run, rc):
            return
        if rc == 0:
            event, kind, reason = JobEvent.SUCCEEDED, "succeeded", f"torchrun exited 0 on {self.node}"
        else:
            event, kind = JobEvent.FAILED, "failed"
            reason = (f"torchrun exited {rc} on {self.node} (restarts exhausted or the entrypoint "
                      f"failed); see `marind logs {run.job}`")
        self.log.info("torchrun_exited", job=run.job, rc=rc)
        self._final_progress(run)
        self._queue(run.job, lambda: update_state(self.client, run.job, event, reason=reason,
                                                  restarts=run.restarts, step=run.step or None))
        self._emit(run.job, kind, {"rc": rc, "step": run.step})
        self._leave(run, f"torchrun exited {rc}")
        key = self.client.key("jobs", run.job, "nodes", self.node)
        self._queue(run.job, lambda: self.client.delete(key))

    def _ft_others_train_on(self, run: JobRun, rc: int) -> bool:
        """A torchft replica group on this node gave up (restarts exhausted): this node leaves the
        job, and the job fails only if no other node is still in it. Our record goes first, then
        we count the others, so of several groups failing at once the last to leave sees none."""
        key = self.client.key("jobs", run.job, "nodes", self.node)
        try:
            self.client.delete(key)
            others = sorted(n for n in job_nodes(self.client, run.job) if n != self.node)
        except ControlPlaneUnavailable:
            return False          # cannot tell: fail the job as an elastic one would
        if not others:
            return False
        self.log.warning("ft_group_failed", job=run.job, rc=rc, replica_group=run.ft.launched_slot,
                         others=others, action="this node leaves the job; the other groups train on")
        self._final_progress(run)
        self._emit(run.job, "group_failed", {"rc": rc, "replica_group": run.ft.launched_slot, "step": run.step,
                                             "remaining_nodes": others})
        self._leave(run, f"torchrun exited {rc}: replica group failed")
        return True

    def _handle_hang(self, run: JobRun, records: list, why: str) -> None:
        self.log.warning("hang_detected", job=run.job, reason=why)
        self.metrics.inc("marind_hangs_total")
        dumped = run.sup.signal_workers(signal.SIGUSR1)      # faulthandler: stacks into the log
        time.sleep(HANG_DUMP_WAIT_S)
        killed = run.sup.signal_workers(signal.SIGKILL)
        self._emit(run.job, "hang_detected", {"reason": why, "ranks": [r.rank for r in records],
                                              "stack_dumped": dumped, "killed": killed})
        run.hang.reset()

    def _watch_checkpoints(self, run: JobRun, records: list, now: float) -> None:
        if not records:
            return
        first = min(records, key=lambda r: r.local_rank)
        if first.phase == "checkpointing":
            run.ckpt_since = run.ckpt_since or now
        elif run.ckpt_since is not None:
            self.metrics.observe("marind_checkpoint_duration_seconds", now - run.ckpt_since)
            run.ckpt_since = None
        rank0 = next((r for r in records if r.rank == 0), None)
        if rank0 is not None and rank0.last_checkpoint_step is not None:
            if run.last_ckpt_step is not None and rank0.last_checkpoint_step > run.last_ckpt_step:
                self._emit(run.job, "checkpoint_committed", {"step": rank0.last_checkpoint_step})
            run.last_ckpt_step = rank0.last_checkpoint_step

    # -- reporting to etcd --------------------------------------------------------------------
    def _report(self, run: JobRun, now: float, records: list | None = None, force: bool = False) -> None:
        if not self.etcd_ok and not force:
            return
        run.last_report = now
        workers = [{"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid} for w in run.sup.workers()]
        state = "running" if workers else ("starting" if run.generations == 0 else "restarting")
        record = {"state": state, "torchrun_pid": run.sup.pid, "workers": workers, "restarts": run.restarts,
                  "step": run.step, "updated_at": now, "host": self.registry.record["host"],
                  "agent_pid": os.getpid(), "node": self.node, "round": run.generations}
        if run.ft is not None:
            record["ft"] = run.ft.report()
        try:
            self.client.put_json(self.client.key("jobs", run.job, "nodes", self.node), record,
                                 lease=self.registry.lease)
            summary = prog.job_summary(records or [])
            if summary is not None:
                self.client.put_json(self.client.key("jobs", run.job, "progress"), summary)
            for gone in run.members.poll() if run.members is not None else ():
                self.log.warning("node_lost", job=run.job, lost=gone)
                self._emit(run.job, "node_lost", {"node": gone})
        except ControlPlaneUnavailable:
            self.etcd_ok = False

    def _emit(self, job: str, kind: str, detail: dict) -> None:
        at = time.time()
        self._queue(job, lambda: append_event(self.client, job, kind, self.node, detail, now=at))

    def _queue(self, job: str, action: Callable[[], object]) -> None:
        self._outbox.append((job, action))
        if self.etcd_ok:
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        while self._outbox:
            job, action = self._outbox[0]
            try:
                action()
            except ControlPlaneUnavailable:
                self.etcd_ok = False
                return
            except Exception as exc:  # noqa: BLE001 - recorded; one bad write must not block the rest
                self.log.error("etcd_write_failed", job=job, error=f"{type(exc).__name__}: {exc}")
            self._outbox.pop(0)

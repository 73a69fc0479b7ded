"""One simulated node of ``bench/scale.py``: marind's control-plane code over a stub for the workers.

A ``SimNode`` holds what a node's agent and its torchrun hold, made of marind's own classes:

* the agent side (one ``EtcdClient``): ``NodeRegistry`` (the node key under its lease and the
  keep-alive thread, default TTL), ``ChangeWatch`` and ``list_job_ids``/``read_job`` (the job
  watch and its reads), an ``Outbox`` (the ``node_joined`` event), the node's job record and
  the job's progress every ``report_interval`` (what ``RunMonitor.report`` writes, with the
  count of registered nodes the agent's metric reads), ``NodeLosses``/``Membership`` (a peer's
  loss: the poll, ``decisions.on_node_loss``, the rendezvous' lost marker, the claim, the
  restart), ``decisions.fence_due`` every tick, and the node's data-network row with the job's
  rows kept from a watch (``ReachRows``: put when it changes, read every tick as the agent's
  data watch does; the row names an endpoint and the ring's probe targets, and no probe runs);
* the torchrun side (a second ``EtcdClient``, as torchrun is a process of its own): marind's
  etcd3 rendezvous handler (``marind.rendezvous.handler.create_handler``), driven as torch's
  elastic agent drives it: ``next_rendezvous`` for a round, ``num_nodes_waiting`` every
  monitor interval (0.5 s, what marind passes torchrun) while the workers run, and
  ``next_rendezvous`` again when the workers fail;
* the workers: a stub. They "step" on every agent tick while their round runs, unless
  stalled (a peer went silent: a collective with it blocks); ``kill_workers`` fails them.

The agent ticks of a few nodes run on one thread in turn (``tick``), their outbox flushes on
another (``flush``); each torchrun is a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousParameters

from marind.agent.decisions import fence_due, stall_window
from marind.agent.liveness.data_decisions import ProbeRing
from marind.agent.liveness.reach_rows import ReachRows
from marind.agent.membership import Membership, report_record
from marind.agent.node_losses import NodeLosses
from marind.agent.outbox import Outbox
from marind.agent.registry import NodeRegistry
from marind.control.change_watch import ChangeWatch
from marind.control.job_records import list_job_ids, read_job
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.rendezvous.handler import create_handler

#: torchrun's monitor interval as marind starts it (``torchrun_args``: ``--monitor-interval=0.5``)
MONITOR_S = 0.5
#: workers per simulated node (their entries in the node's record)
GPUS = 8


@dataclass(frozen=True)
class SimConf:
    """What every simulated node runs with (the agent's defaults unless the bench says otherwise)."""

    endpoint: str
    prefix: str
    lease_ttl: int = 10
    report_interval: float = 2.0
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    nodes_min: int = 1
    nodes_max: int = 1
    join_events: bool = True          # each node's ``node_joined`` (False: a diagnostic, not the agent)


class SimNode:
    """One node: its agent's control-plane parts, its torchrun's rendezvous, stub workers (module doc)."""

    def __init__(self, name: str, conf: SimConf):
        self.name, self.conf = name, conf
        self.log = get_logger("bench.scale", node=name)
        self.client = EtcdClient(conf.endpoint, prefix=conf.prefix)
        self.registry = NodeRegistry(self.client, name, slots=GPUS, ttl=conf.lease_ttl)
        self.watch = ChangeWatch(self.client)
        self.outbox = Outbox(self.client, name, online=lambda: True, offline=lambda: None)
        self.incarnation = f"{os.getpid()}.{name}"
        self.job: str | None = None
        self.losses: NodeLosses | None = None
        self.reach: ReachRows | None = None
        self.ring: ProbeRing | None = None     # this node's probe targets in its job (DataWatch.ring)
        self.handler = None
        self.rounds: list[dict] = []          # each round this node got a rank in: round, rank, world, at
        self.errors: list[str] = []
        self.step = 0
        self.progress_at: float | None = None
        self.running = False                  # its workers run (a rank in the current round)
        self.stalled = False                  # ... but a collective with a silent peer blocks them
        self.silent = False
        self.last_report = self.last_count = 0.0
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._torchrun: threading.Thread | None = None

    def start(self) -> None:
        """Register under a lease and start its keep-alive (``NodeRegistry``)."""
        self.registry.register()
        self.registry.start()

    # -- the agent's tick -------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """One pass of the agent's loop for this node (``marind.agent.daemon.Agent.tick``'s parts)."""
        if self.silent:
            return
        try:
            fence_due(last_renewal=self.registry.last_renewal, ttl=self.registry.ttl, now=now,
                      progress_at=self.progress_at, stall_s=stall_window(self.registry.ttl),
                      revoked=self.registry.revoked)
            if self.watch.due():
                self.watch.begin_read()
                for job in list_job_ids(self.client):
                    view = read_job(self.client, job)
                    if self.job is None and not view.state.state.is_terminal():
                        self._start_run(view.id, now)
            if self.running and not self.stalled:
                self.step += 1
                self.progress_at = now
            if self.job is not None and now - self.last_report >= self.conf.report_interval:
                self.report(now)
            if self.reach is not None and self.losses is not None:
                self._reach(now)
            if self.losses is not None:
                self.losses.act(now, stall_window(self.registry.ttl), workers_running=lambda: self.running,
                                progress_at=self.progress_at, torchft=False, kill_workers=self.kill_workers)
        except ControlPlaneUnavailable as exc:
            self.errors.append(f"tick: {exc}")

    def flush(self) -> None:
        """The outbox's writes (events), as the agent's tick ends with; here on a thread of its own,
        so that one node's event-number contention does not hold the other nodes' ticks (each
        agent has its own loop)."""
        if not self.silent:
            self.outbox.flush()

    def _start_run(self, job: str, now: float) -> None:
        self.job = job
        self.losses = NodeLosses(job, Membership(self.client, job, self.name, self.incarnation), self.outbox,
                                 self.log)
        self.reach = ReachRows(self.client, job, self.name)
        self.ring = ProbeRing(job, self.name)
        if self.conf.join_events:
            self.outbox.event(job, "node_joined", {"torchrun_pid": os.getpid(), "slots": GPUS})
        self._torchrun = threading.Thread(target=self._run_torchrun, name=f"torchrun-{self.name}", daemon=True)
        self._torchrun.start()
        self.report(now)

    def record(self, now: float) -> dict:
        """This node's record of the job, shaped as ``RunMonitor.node_record`` writes it."""
        base = self.rounds[-1]["rank"] * GPUS if self.rounds else 0
        workers = [{"rank": base + i, "local_rank": i, "pid": 100000 + i} for i in range(GPUS)] if self.running else []
        return {"state": "running" if workers else "starting", "torchrun_pid": os.getpid(), "workers": workers,
                "restarts": max(0, len(self.rounds) - 1), "step": self.step, "updated_at": now, "host": self.name,
                "agent_pid": os.getpid(), "node": self.name, "round": len(self.rounds),
                "incarnation": self.incarnation}

    def report(self, now: float) -> None:
        """What the agent writes every ``report_interval`` (``Agent._report``, ``RunMonitor.report``)."""
        assert self.job is not None and self.losses is not None
        self.last_report = now
        c = self.client
        report_record(c, self.job, self.name, self.record(now), self.registry.lease, self.losses.members)
        if self.running and self.rounds and self.rounds[-1]["rank"] == 0:
            c.put_json(c.key("jobs", self.job, "progress"),
                       {"step": self.step, "loss": 1.0, "tokens_per_s": 1e6, "last_checkpoint_step": None,
                        "world_size": self.rounds[-1]["world"] * GPUS, "phase": "training", "updated_at": now})
        self.losses.poll()
        if now - self.last_count >= max(self.conf.report_interval, self.watch.resync_s):
            self.last_count = now
            c.count_prefix(c.key("nodes") + "/")          # the agent's marind_nodes metric

    def _reach(self, now: float) -> None:
        """The data watch's etcd part: this node's row put when it changed (its probe targets move
        with the job's nodes), the job's rows refreshed (``DataNetwork.tick``)."""
        assert self.reach is not None and self.losses is not None and self.ring is not None
        targets = self.ring.targets(frozenset(self.losses.members.known) | {self.name})
        row = {"addr": self.name, "port": 0, "token": self.incarnation, "link_up": True, "at": now,
               "probed": sorted(targets), "down": {}}
        self.reach.publish(row, self.registry.lease)
        self.reach.refresh()

    def kill_workers(self) -> list[int]:
        """``NodeLosses``' restart: the workers fail, torchrun goes to a new round."""
        self.running = False
        self._failed.set()
        return [100000 + i for i in range(GPUS)]

    # -- the torchrun ------------------------------------------------------------------------
    def _run_torchrun(self) -> None:
        c = self.conf
        params = RendezvousParameters("etcd3", c.endpoint, self.job or "", c.nodes_min, c.nodes_max,
                                      prefix=c.prefix, **dict(c.rdzv_conf))
        try:
            self.handler = create_handler(params, node=self.name)
            while not self._stop.is_set():
                self._failed.clear()
                info = self.handler.next_rendezvous()
                self.rounds.append({"round": len(self.rounds), "rank": info.rank, "world": info.world_size,
                                    "at": time.time()})
                self.running, self.stalled = True, False
                while not self._stop.is_set() and not self._failed.wait(MONITOR_S):
                    self.handler.num_nodes_waiting()
        except Exception as exc:  # noqa: BLE001 - a stopped or silenced node's handler fails; reported
            if not self._stop.is_set():
                self.errors.append(f"torchrun: {type(exc).__name__}: {exc}")

    # -- the bench's faults ------------------------------------------------------------------
    def silence(self) -> None:
        """Power off: keep-alives (node and rendezvous), reports and workers stop at once."""
        self.silent = True
        self._stop.set()
        self._failed.set()
        self.registry._stop.set()         # its keep-alive thread ends at its next wake-up, renewing nothing
        if self.handler is not None:
            self.handler._stop_heartbeats()
        if self.losses is not None:
            self.losses.members.close()   # its watch of the job's records too
        if self.reach is not None:
            self.reach.close(drop=False)  # and of the rows (its row goes with its lease)

    def stall(self) -> None:
        """A collective with a silent peer blocks: the workers stop making progress."""
        if self.running:
            self.stalled = True

    def stop(self) -> None:
        """End the simulation of this node (its keys are left to their leases)."""
        self._stop.set()
        self._failed.set()
        self.registry._stop.set()
        if self.handler is not None:
            self.handler._stop_heartbeats()
        self.watch.stop()
        if self.losses is not None:
            self.losses.members.close()

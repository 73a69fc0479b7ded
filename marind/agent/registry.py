"""Node registration ``{p}/nodes/{node}`` under a lease, kept alive by a thread.

The lease (TTL ``lease_ttl``) carries the node key and every per-job node
record the agent writes, so they vanish when the agent dies. The
keep-alive thread refreshes it every ``renew_interval(ttl)`` seconds (TTL/10)
and notes when a renewal last succeeded (``last_renewal``: the request's send
time, so the lease lives at least ``ttl`` past it) and the last one the
node's workers may commit on (``trusted_renewal``: not one that follows a gap
longer than ``silent_window``, when the peers may be declaring the node lost
at that very moment, ``marind.core.lease_file``); when etcd is unreachable it
counts the failure and retries. When etcd answers that the lease expired, the
thread only sets ``expired`` (and ``revoked`` when that came sooner than
``ttl`` after the last renewal: the lease cannot have run out, so the other
agents revoked it, declaring this node lost while it was silent,
``marind.agent.liveness.silence``): the agent first fences what ran under the old lease
(``decisions.fence_due``; every run when ``revoked``), then calls ``rejoin``
for a new lease, so nothing is written under the new lease for a round the
others replaced.
Errors are recorded (``last_error``), never raised from the thread.

A node name is unique: the node key is created only if absent; when it is
held (its lease is live), ``may_take_over`` decides. A restarted agent on
the same host whose previous holder's process is gone takes the key over
(compare-and-swap onto its own lease); any other holder is refused with
``NodeNameTaken`` (`marind agent` exits 2 naming the holder's host and pid).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

import psutil

from marind import __version__
from marind.core import etcd_txn as T
from marind.core.errors import ControlPlaneUnavailable, UsageError
from marind.core.etcd_client import EtcdClient
from marind.core.lease_file import renew_interval, silent_window
from marind.core.log import get_logger


class NodeNameTaken(UsageError):
    """Another live agent holds this node's name (exit 2)."""


def process_alive(pid: int, started_before: float) -> bool:
    """Is ``pid`` a live process that was started by ``started_before`` (not a reused pid, not a zombie)?

    Args:
        pid: the process id.
        started_before: the time the process claims to have started (plus a second of slack).

    Returns:
        True when such a process runs on this host.
    """
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= started_before + 1.0
    except (psutil.Error, OSError):
        return False


def may_take_over(holder: dict, *, host: str, pid: int,
                  alive: Callable[[int, float], bool] = process_alive) -> tuple[bool, str]:
    """May an agent take a node name whose key another record holds under a live lease?

    Args:
        holder: the record under the node key (``host``, ``pid``, ``started_at``).
        host: this agent's host name.
        pid: this agent's pid.
        alive: tells whether ``(pid, started_at)`` is a live process on this host.

    Returns:
        (take, why).
    """
    h_host, h_pid = holder.get("host"), holder.get("pid")
    if h_host != host:
        return False, f"it runs on another host ({h_host})"
    if not isinstance(h_pid, int):
        return False, "its record names no pid"
    if h_pid == pid:
        return True, "this agent's own record"
    if alive(h_pid, float(holder.get("started_at") or 0.0)):
        return False, f"process {h_pid} on this host is alive"
    return True, f"the previous agent on this host (pid {h_pid}) is gone"


class NodeRegistry:
    def __init__(self, client: EtcdClient, node: str, *, slots: int, labels: dict | None = None,
                 ttl: int = 10, on_keepalive_failure=None):
        self.client = client
        self.node = node
        self.ttl = ttl
        self.record = {"node": node, "host": socket.gethostname(), "slots": slots,
                       "labels": labels or {}, "version": __version__,
                       "started_at": time.time(), "pid": os.getpid()}
        self.lease = None
        self.generation = 0          # bumped on every (re-)registration
        self.last_renewal = 0.0      # time.time() when the last successful renewal was sent
        self.trusted_renewal = 0.0   # ... the last one not after a gap longer than the silent window
        self.expired = False         # etcd said the lease expired; ``rejoin`` takes a new one
        self.revoked = False         # ... sooner than ``ttl`` after the last renewal: the others revoked it
        self.connected = False
        self.last_error: str | None = None
        self._on_failure = on_keepalive_failure
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.log = get_logger(__name__, node=node)

    @property
    def key(self) -> str:
        return self.client.key("nodes", self.node)

    def register(self) -> None:
        """Take a new lease and write the node key, unless another live agent holds the name.

        Raises:
            NodeNameTaken: the key is held by a live agent elsewhere, or by a live process here.
            ControlPlaneUnavailable: etcd is unreachable.
        """
        with self._lock:
            sent = time.time()
            lease = self.client.lease(self.ttl)
            value = json.dumps(self.record, sort_keys=True)
            try:
                self._claim(value, lease)
            except NodeNameTaken:
                self._revoke_quietly(lease)
                raise
            self.lease = lease
            self.last_renewal = self.trusted_renewal = sent
            self.expired = self.revoked = False
            self.generation += 1
            self.connected = True
            self.last_error = None
        self.log.info("node_registered", lease=lease.id, generation=self.generation)

    def _claim(self, value: str, lease) -> None:
        ok, current, rev = self.client.compare_and_swap_value(self.key, value, 0, lease=lease)
        if ok:
            return
        try:
            holder = json.loads(current or b"{}")
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        take, why = may_take_over(holder, host=str(self.record["host"]), pid=os.getpid())
        if take:
            ok, _ = self.client.compare_and_swap(self.key, value, rev, lease=lease)
            if ok:
                self.log.info("node_taken_over", reason=why)
                return
            why = "another agent registered it at the same moment"
        raise NodeNameTaken(
            f"node name {self.node!r} is held by a live agent on host {holder.get('host', '?')}, pid "
            f"{holder.get('pid', '?')} ({why}): stop that agent, or start this one with another --node")

    def _revoke_quietly(self, lease) -> None:
        try:
            self.client.revoke_lease(lease)
        except ControlPlaneUnavailable:
            pass

    def set_condition(self, name: str, value: dict | None) -> None:
        """Add ``name`` to the node's record (None: remove it), e.g. ``state_dir_full``; ``publish``
        writes it, and every later registration carries it."""
        with self._lock:
            if value is None:
                self.record.pop(name, None)
            else:
                self.record[name] = value

    def publish(self) -> None:
        """Rewrite the node key with the record as it is now, under the node's lease, only while the
        key is still on that lease (a node whose lease lapsed writes nothing; its rejoin will).

        Raises:
            ControlPlaneUnavailable: etcd is unreachable.
        """
        with self._lock:
            lease, value = self.lease, json.dumps(self.record, sort_keys=True)
        if lease is None or self.expired:
            return
        self.client.txn([T.lease_is(self.key, lease.id)], [T.put(self.key, value, lease.id)])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="marind-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = renew_interval(self.ttl)
        while not self._stop.wait(interval if self.connected else 1.0):
            try:
                if self.lease is None:
                    self.register()
                    continue
                if self.expired:
                    continue             # the agent fences, then rejoins
                lease, sent = self.lease, time.time()
                remaining = self.client.refresh_lease(lease)
                with self._lock:
                    if self.lease is not lease:
                        continue         # registered anew meanwhile: this answer is about the old lease
                    if remaining <= 0:
                        self.revoked = sent - self.last_renewal < self.ttl
                        self.expired = True
                        self.log.warning("lease_revoked" if self.revoked else "lease_expired", lease=lease.id,
                                         renewed_s_ago=round(sent - self.last_renewal, 1))
                        continue
                    self._renewed(sent)
                if not self.connected:
                    self.connected = True
                    self.log.info("etcd_reachable_again")
            except ControlPlaneUnavailable as exc:
                if self.connected:
                    self.log.warning("etcd_keepalive_failed", error=str(exc))
                self.connected = False
                self.last_error = str(exc)
                if self._on_failure:
                    self._on_failure()
            except Exception as exc:  # noqa: BLE001 - recorded, the thread must survive
                self.connected = False
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.log.error("keepalive_error", error=self.last_error)
                if self._on_failure:
                    self._on_failure()

    def _renewed(self, sent: float) -> None:
        """A renewal sent at ``sent`` succeeded; it reopens the commit window only if the previous
        one is no older than the silent window (``trusted_renewal``)."""
        if sent - self.last_renewal <= silent_window(self.ttl):
            self.trusted_renewal = sent
        self.last_renewal = sent

    def rejoin(self, force: bool = False) -> bool:
        """After an expiry: a new lease and registration (the agent has fenced its runs first).

        Args:
            force: register anew even when the old lease is still alive (the other agents
                declared this incarnation lost).

        Returns:
            True when the node registered anew; False when its lease was still alive.

        Raises:
            ControlPlaneUnavailable: etcd is unreachable.
        """
        if not force and not self.expired and self.lease is not None:
            sent = time.time()
            if self.client.refresh_lease(self.lease) > 0:
                self._renewed(sent)
                return False
        self.register()
        return True

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.lease is not None:
            try:
                self.client.revoke_lease(self.lease)
            except ControlPlaneUnavailable:
                pass

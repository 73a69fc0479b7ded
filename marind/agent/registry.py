"""Node registration ``{p}/nodes/{node}`` under a lease, kept alive by a thread.

The lease (TTL ``lease_ttl``) carries the node key and every per-job node
record the agent writes, so they vanish when the agent dies. The
keep-alive thread refreshes it every ``ttl/3`` seconds and notes when a
renewal last succeeded (``last_renewal``: the request's send time, so the
lease lives at least ``ttl`` past it); when etcd is unreachable it counts
the failure and retries. When etcd answers that the lease expired, the
thread only sets ``expired``: the agent first fences what ran under the old
lease (``decisions.fence_due``), then calls ``rejoin`` for a new lease, so
nothing is written under the new lease for a round the others replaced.
Errors are recorded (``last_error``), never raised from the thread.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from marind import __version__
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger


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
        self.expired = False         # etcd said the lease expired; ``rejoin`` takes a new one
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
        """Take a new lease and write the node key (raises ControlPlaneUnavailable)."""
        with self._lock:
            sent = time.time()
            lease = self.client.lease(self.ttl)
            self.client.put_json(self.key, self.record, lease=lease)
            self.lease = lease
            self.last_renewal = sent
            self.expired = False
            self.generation += 1
            self.connected = True
            self.last_error = None
        self.log.info("node_registered", lease=lease.id, generation=self.generation)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="marind-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.5, self.ttl / 3)
        while not self._stop.wait(interval if self.connected else 1.0):
            try:
                if self.lease is None:
                    self.register()
                    continue
                if self.expired:
                    continue             # the agent fences, then rejoins
                sent = time.time()
                remaining = self.client.refresh_lease(self.lease)
                if remaining <= 0:
                    self.log.warning("lease_expired", lease=self.lease.id,
                                     renewed_s_ago=round(sent - self.last_renewal, 1))
                    self.expired = True
                    continue
                self.last_renewal = sent
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

    def rejoin(self) -> bool:
        """After an expiry: a new lease and registration (the agent has fenced its runs first).

        Returns:
            True when the node registered anew; False when its lease was still alive.

        Raises:
            ControlPlaneUnavailable: etcd is unreachable.
        """
        if not self.expired and self.lease is not None:
            sent = time.time()
            if self.client.refresh_lease(self.lease) > 0:
                self.last_renewal = sent
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


def live_nodes(client: EtcdClient) -> dict[str, dict]:
    rows = client.get_prefix_json(client.key("nodes") + "/")
    return {k.rsplit("/", 1)[-1]: v for k, v in rows.items() if isinstance(v, dict)}

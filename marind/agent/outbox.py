"""What the agent writes to etcd about its jobs, in order, surviving an etcd outage.

Every write of the agent's main loop that must not be lost (a state
change, an event, the job's final progress, this node's record going, a
clean departure) goes through one ``Outbox``. A write is queued; while
etcd is reachable the queue is flushed at once, oldest first. When a
write finds etcd away (``ControlPlaneUnavailable``) the flush stops there,
the agent is told (``offline``), and the write and everything after it
wait for the next flush, in the same order. Any other error of one write
is logged and that write dropped, so one bad write never blocks the rest.

An event is stamped with the time it happened, not the time it reached etcd.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from marind.agent.membership import Membership
from marind.control.events import append_event
from marind.control.failure_causes import keep_first
from marind.control.job_records import update_state
from marind.control.lifecycle import JobEvent
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger


class Outbox:
    """The agent's ordered, outage-proof writes to etcd.

    Args:
        client: the etcd client.
        node: this node's name (events name it).
        online: whether etcd is believed reachable (queued writes are then flushed at once).
        offline: called when a write finds etcd unreachable.
        clock: wall-clock time for event stamps.
    """

    def __init__(self, client: EtcdClient, node: str, *, online: Callable[[], bool],
                 offline: Callable[[], None], clock: Callable[[], float] = time.time):
        self.client, self.node = client, node
        self._online, self._offline, self._clock = online, offline, clock
        self._queue: deque[tuple[str, Callable[[], object]]] = deque()
        self._lock = threading.RLock()      # one flush at a time: the queue's head is written once, in order
        self.log = get_logger(__name__, node=node)

    def __len__(self) -> int:
        return len(self._queue)

    # -- what the agent writes ------------------------------------------------------------
    def state(self, job: str, event: JobEvent, *, reason: str, restarts: int | None = None,
              step: int | None = None) -> None:
        """Move the job's state through the transition function (``job_records.update_state``)."""
        self.put(job, lambda: update_state(self.client, job, event, reason=reason, restarts=restarts, step=step))

    def event(self, job: str, kind: str, detail: dict) -> None:
        """Append to the job's event ring, stamped now."""
        at = self._clock()
        self.put(job, lambda: append_event(self.client, job, kind, self.node, detail, now=at))

    def last_error(self, job: str, record: dict) -> None:
        """Write why the job's workers last failed (``{p}/jobs/{job}/last_error``, docs/design.md §2).

        Args:
            job: the job's id.
            record: ``{"line", "node", "at", "source", "restarts", ...}``; one marked ``echo`` (a peer
                gone) does not replace a cause another node recorded just before it
                (``failure_causes.keep_first``).
        """
        key = self.client.key("jobs", job, "last_error")

        def write() -> None:
            if keep_first(self.client.get_json(key), record):
                self.client.put_json(key, record)
        self.put(job, write)

    def progress(self, job: str, summary: dict) -> None:
        """Write the job's progress record (``{p}/jobs/{job}/progress``)."""
        key = self.client.key("jobs", job, "progress")
        self.put(job, lambda: self.client.put_json(key, summary))

    def drop_node_record(self, job: str) -> None:
        """Delete this node's record of the job (``{p}/jobs/{job}/nodes/{node}``)."""
        key = self.client.key("jobs", job, "nodes", self.node)
        self.put(job, lambda: self.client.delete(key))

    def leaving(self, job: str, members: Membership | None, why: str) -> None:
        """Mark this node's departure as clean before its record goes (no node_lost for it)."""
        if members is not None:
            self.put(job, lambda: members.leaving(why))

    def drop_job(self, job: str) -> int:
        """Forget the queued writes about ``job`` (its run here was fenced); returns how many."""
        with self._lock:
            before = len(self._queue)
            self._queue = deque(item for item in self._queue if item[0] != job)
            return before - len(self._queue)

    # -- the queue --------------------------------------------------------------------------
    def put(self, job: str, action: Callable[[], object]) -> None:
        """Queue one write; flush at once while etcd is reachable.

        Args:
            job: the job the write is about (for the log).
            action: the write; may raise ``ControlPlaneUnavailable``.
        """
        with self._lock:
            self._queue.append((job, action))
        if self._online():
            self.flush()

    def flush(self) -> bool:
        """Write what is queued, oldest first.

        Returns:
            True when the queue is empty; False when etcd went away (the rest waits).
        """
        with self._lock:           # another thread's flush (or put) waits: no write twice, none skipped
            while self._queue:
                job, action = self._queue[0]
                try:
                    action()
                except ControlPlaneUnavailable:
                    self._offline()
                    return False
                except Exception as exc:  # noqa: BLE001 - recorded; one bad write must not block the rest
                    self.log.error("etcd_write_failed", job=job, error=f"{type(exc).__name__}: {exc}")
                self._queue.popleft()
            return True

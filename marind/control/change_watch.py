"""When must an agent read the jobs from etcd again? On a change, and at a slow resync.

Reading every job's spec, state and cancel key on every tick costs etcd
O(nodes x jobs) reads per tick. Instead, whoever changes the set of jobs
or a job's state (submit, a state transition, cancel, ``marind rm``) also
touches one key, ``{p}/jobs_changed`` (``marind.control.job_records.mark_jobs_changed``);
each agent watches that key and reads the jobs only when it changed, when
its own situation asks for it (``poke``: a job waiting for free slots, a
run that ended here), while etcd is away, and every ``resync_s`` seconds
in case a watch event was lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from marind.control.job_records import changed_key
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger

#: a lost watch event is noticed this late at worst; each resync reads every job (docs/perf.md, "A thousand nodes")
DEFAULT_RESYNC_S = 30.0


class ChangeWatch:
    """When to read again, from a watch on ``prefix``.

    Args:
        client: the etcd client.
        resync_s: read at least this often, in case a watch event was lost.
        clock: monotonic time (injected in tests).
        prefix: the keys to watch (default ``{p}/jobs_changed``, what agents follow; `marind
            submit --wait` follows one job's keys, ``{p}/jobs/{job}/``).
    """

    def __init__(self, client: EtcdClient, resync_s: float = DEFAULT_RESYNC_S,
                 clock: Callable[[], float] = time.monotonic, prefix: str | None = None):
        self.client, self.resync_s, self.clock = client, resync_s, clock
        self.prefix = prefix or changed_key(client)
        self.log = get_logger(__name__)
        self._lock = threading.Lock()
        self._dirty = True
        self._last_read = float("-inf")
        self._watch_id: int | None = None

    def _on_event(self, event) -> None:
        with self._lock:
            self._dirty = True
            if isinstance(event, BaseException):      # the watch broke: read every tick until it is back
                self._watch_id = None

    def _ensure_watch(self) -> None:
        if self._watch_id is not None:
            return
        try:
            self._watch_id = self.client.watch_prefix(self.prefix, self._on_event)
        except ControlPlaneUnavailable as exc:
            self.log.debug("job_watch_unavailable", error=str(exc))

    def due(self) -> bool:
        """Must the jobs be read now (a change seen, a poke, no watch, or the resync is due)?"""
        with self._lock:
            return (self._dirty or self._watch_id is None
                    or self.clock() - self._last_read >= self.resync_s)

    def begin_read(self) -> None:
        """Call right before reading the jobs: a change seen from now on asks for another read."""
        self._ensure_watch()
        with self._lock:
            self._dirty = False
            self._last_read = self.clock()

    def poke(self) -> None:
        """Read the jobs again at the next tick."""
        with self._lock:
            self._dirty = True

    def stop(self) -> None:
        """Cancel the watch."""
        if self._watch_id is not None:
            self.client.cancel_watch(self._watch_id)
            self._watch_id = None

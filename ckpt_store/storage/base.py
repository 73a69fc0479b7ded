"""What both storage backends share: the I/O threads, the write-rate limit, keys to paths.

The I/O threads are one pool for foreground work, plus for each ``nice`` a
second set whose threads run that much nicer (an async save's encode and
write work: Linux lets a thread lower its own priority, never raise it back,
hence separate sets). ``rate_limit`` caps the bytes/s of all writes together.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any


class StorageBase:
    """The part of a backend that is not about where the bytes go (see ``storage.Storage``)."""

    def __init__(self, url: str, fs: Any, root: str, io_threads: int = 4, rate_limit: float | None = None):
        self.url = url
        self.fs = fs
        self.root = root
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self.s3 = "s3" in protocols
        self.in_process = "memory" in protocols
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ckpt-io")
        self._background_pools: dict[int, ThreadPoolExecutor] = {}
        self._rate = rate_limit            # bytes/s over all writer threads; None = unlimited
        self._rate_lock = threading.Lock()
        self._next_free = 0.0

    def _throttle(self, nbytes: int) -> None:
        """Keep writes under ``rate_limit`` bytes/s (spares a small machine's disk and NIC)."""
        if not self._rate:
            return
        with self._rate_lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self._rate
            delay = self._next_free - now
        time.sleep(delay)

    def pool(self, nice: int = 0) -> ThreadPoolExecutor:
        """The I/O threads; ``nice`` > 0: a second set whose threads run that much nicer
        (per thread: Linux lets a thread lower its own priority, never raise it back)."""
        if nice <= 0:
            return self._pool
        if nice not in self._background_pools:
            self._background_pools[nice] = ThreadPoolExecutor(
                max_workers=self.io_threads, thread_name_prefix=f"ckpt-io-nice{nice}",
                initializer=_nice_this_thread, initargs=(nice,))
        return self._background_pools[nice]

    def path(self, key: str) -> str:
        """The backend's path of ``key`` (the root itself for "")."""
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, pieces: list, crc: int | None = None) -> None:
        raise NotImplementedError

    def begin_part(self, background: bool) -> dict[str, float]:
        """A rank's part of a save starts; object stores have one write path."""
        return {}

    def end_part(self, nbytes: int, seconds: float, background: bool) -> dict[str, float]:
        """The part's chunk writes are over (``nbytes`` in ``seconds``): the path they took."""
        return {}

    def write_many(self, items: list[tuple[str, list]]) -> None:
        """Write objects with bounded concurrency; raises the first failure."""
        for fut in [self._pool.submit(self.write, k, p) for k, p in items]:
            fut.result()

    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def read_json(self, key: str) -> Any:
        """The object ``key``, decoded as JSON."""
        return json.loads(self.read(key))

    def close(self) -> None:
        """Stop the I/O threads (work already queued still runs)."""
        self._pool.shutdown(wait=False)
        for pool in self._background_pools.values():
            pool.shutdown(wait=False)


def run_all(pool: ThreadPoolExecutor, fn: Callable[[int, Any], Any], items: Iterable) -> list:
    """``fn(i, item)`` for every item in ``pool``, each submitted as soon as ``items`` (a
    list, or an iterator that plans them) yields it; waits for all of them (none still runs
    when this returns or raises), then returns their results in order or raises the first
    failure in order (an error of ``items`` itself is raised once the submitted ones are over)."""
    futures = []
    try:
        for i, item in enumerate(items):
            futures.append(pool.submit(fn, i, item))
    finally:
        wait(futures)
    return [f.result() for f in futures]


def json_bytes(obj: Any) -> bytes:
    """How ``write_json_atomic`` encodes an object (indented, keys sorted)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _nice_this_thread(nice: int) -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):
        pass   # not Linux, or not allowed: the save runs at normal priority

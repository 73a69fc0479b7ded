"""The storage seam of ckpt_store: one small protocol over a store root, and ``open_storage``.

Keys are relative to the store root and use "/". Writes take a list of
buffers (no concatenation on local disks); range reads are batched. Two
backends implement it:

* ``local_disk.LocalStorage`` (file://): O_DIRECT chunk writes, ``preadv``
  reads, ``fdatasync`` per file and directory fsyncs for durability (``syncfs``
  for a large part: ``flush_mode``);
* ``object_store.FsspecStorage`` (s3://, memory://, any other fsspec URL):
  crc32c-checked PUTs on S3, one HEAD per ``exists``;
* ``ckpt_store.memory.peer_storage.PeerMemoryStorage`` (peermem://): the memory tier, this
  node's host memory with a replica on the next node (issue 33).

What they share (the I/O threads, the write-rate limit) is in ``base``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import fsspec

from ckpt_store.storage.local_disk import LocalStorage
from ckpt_store.storage.object_store import FsspecStorage, s3_defaults


class Storage(Protocol):
    """What the store, its writer and its loader do with a store root.

    Attributes:
        url: the store URL, normalized (``file://`` + an absolute path for a bare path).
        root: the root's path in ``fs``.
        fs: the fsspec filesystem the URL resolved to (for tools that need an operation
            this protocol lacks, e.g. the CLI's check that an S3 bucket exists).
        local: a local filesystem: renames are atomic and a poll is one stat.
        s3: an S3 store.
        in_process: the objects live in this process (memory://): no other process sees them.
    """

    url: str
    root: str
    fs: Any
    local: bool
    s3: bool
    in_process: bool

    def pool(self, nice: int = 0) -> ThreadPoolExecutor:
        """The I/O threads; ``nice`` > 0: a second set whose threads run that much nicer."""
        ...

    def path(self, key: str) -> str:
        """The backend's path of ``key`` (the root itself for "")."""
        ...

    def write(self, key: str, pieces: list, crc: int | None = None) -> None:
        """Write one object from the buffers ``pieces``; ``crc``: its crc32c, checked by S3."""
        ...

    def begin_part(self, background: bool) -> dict[str, float]:
        """A rank's part of a save starts (``background``: an async save): the backend picks its
        write path (local disks: ``write_mode``); returns timings to report (``{"direct_io": 0/1}``)."""
        ...

    def end_part(self, nbytes: int, seconds: float, background: bool) -> dict[str, float]:
        """The part's chunk objects, ``nbytes`` in all, took ``seconds`` to write; returns the
        write path they took (``{"direct_io": 0/1}`` on a local disk, else empty)."""
        ...

    def write_many(self, items: list[tuple[str, list]]) -> None:
        """Write ``(key, pieces)`` objects with bounded concurrency; raises the first failure."""
        ...

    def write_json_atomic(self, key: str, obj: Any) -> None:
        """Write ``obj`` as JSON so that readers see the old object or the whole new one."""
        ...

    def make_durable(self, keys: list[str]) -> None:
        """Make written ``keys`` survive a power cut (a no-op where a write is durable)."""
        ...

    def read(self, key: str) -> bytes:
        """The whole object ``key`` (FileNotFoundError if absent)."""
        ...

    def read_json(self, key: str) -> Any:
        """The object ``key``, decoded as JSON."""
        ...

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of each ``(key, start, end)``; short at the end of an object."""
        ...

    def read_into(self, reqs: Iterable[tuple[str, int, list]],
                  done: Callable[[int, int], None] | None = None) -> list[int]:
        """Fill each ``(key, start, buffers)`` request's buffers in order; the bytes read per request.
        ``reqs`` may be an iterator: a local disk starts each read as it is yielded.
        ``done(i, n)`` runs in an I/O thread once request ``i`` is read: on a local disk as soon
        as its own read is over (its check overlaps the other reads), on an object store once
        the batch of ranged GETs is in; all are over before this returns or raises the first
        failure."""
        ...

    def exists(self, key: str) -> bool:
        """Does the object ``key`` exist?"""
        ...

    def size(self, key: str) -> int:
        """The size of object ``key`` in bytes."""
        ...

    def object_sizes(self, key: str) -> dict[str, int]:
        """Every object under ``key``, at any depth: {key relative to ``key``: size}."""
        ...

    def list_dir(self, key: str = "") -> list[str]:
        """Names of the entries directly under ``key``, sorted; [] when absent."""
        ...

    def rename(self, key: str, new_key: str) -> None:
        """Rename an object or a prefix (atomic on a local disk only)."""
        ...

    def delete_prefix(self, key: str) -> None:
        """Delete the object or everything under ``key``; nothing if absent."""
        ...

    def close(self) -> None:
        """Stop the I/O threads."""
        ...


def open_storage(url: str, storage_options: dict | None = None, io_threads: int = 4,
                 rate_limit: float | None = None, direct_io: bool | str = "auto") -> Storage:
    """The storage backend for ``url``.

    Args:
        url: ``file://``, ``s3://``, ``memory://`` or any fsspec URL; a bare path is a local one.
        storage_options: fsspec options (S3 gets ``s3_defaults`` where the caller set none).
        io_threads: I/O threads per set (foreground, and each background niceness).
        rate_limit: cap all writes together at this many bytes/s (None: no cap).
        direct_io: local disks: write objects of ``DIRECT_MIN_BYTES`` and more with O_DIRECT
            (True), through the page cache (False), or "auto": O_DIRECT for async saves, the
            path that wrote faster here for sync saves (``write_mode``).

    Returns:
        A ``LocalStorage`` for a local filesystem, else an ``FsspecStorage``.

    Raises:
        Whatever fsspec raises for a URL it cannot open (an unknown protocol, a missing package).
    """
    if "://" not in url:
        url = "file://" + os.path.abspath(url)
    scheme, rest = url.split("://", 1)
    url = f"{scheme}://{rest.rstrip('/')}"   # "memory://" stays a URL, never a local "memory:"
    if scheme == "peermem":     # the memory tier: this node's host memory and its peers' (ckpt_store.memory)
        from ckpt_store.memory.peer_storage import open_peer_memory
        return open_peer_memory(url, storage_options, io_threads)
    fs, root = fsspec.core.url_to_fs(url, **s3_defaults(url, storage_options))
    root = root.rstrip("/")
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"file", "local"}:
        return LocalStorage(url, fs, root, io_threads, rate_limit, direct_io)
    return FsspecStorage(url, fs, root, io_threads, rate_limit)

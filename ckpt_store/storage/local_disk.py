"""The local-disk storage backend (file://): O_DIRECT chunk writes, pread/preadv reads, fsyncs.

Writes take a list of buffers and never concatenate them. Objects of
``DIRECT_MIN_BYTES`` and more bypass the page cache (``write_direct``);
smaller ones are buffered and their writeback started at once
(``sync_file_range``). ``make_durable`` flushes a rank's part with an
``fdatasync`` per file and an ``fsync`` per directory, or one ``syncfs`` for a
large part (``flush_mode``); JSON objects are renamed into place with the
directory fsynced. The store root is created at the first write, and the
parent of each directory level created for it is fsynced right then (once per
store): a new root's own name is durable too.
Range reads run ``pread``/``preadv`` in the I/O threads (they release the GIL); a load's
chunk reads (``read_into``) go around the page cache where each reading rank has a core,
unless the cache holds them already (``read_mode``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ckpt_store.storage.base import StorageBase, json_bytes, run_all
from ckpt_store.storage.direct_io import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    O_DIRECT,
    bounce_buffer,
    direct_cap,
    pread_all,
    scatter,
    write_direct,
)
from ckpt_store.storage.flush_mode import choose_syncfs, dirs_to_sync, dirty_bytes
from ckpt_store.storage.page_cache import resident_pages
from ckpt_store.storage.read_mode import choose_direct_reads, cpus_here, read_through_cache, readers_here
from ckpt_store.storage.write_mode import WriteModes

_IOV_MAX = 512


class LocalStorage(StorageBase):
    """A store root on a local filesystem (see ``storage.Storage`` for the operations)."""

    local = True

    def __init__(self, url: str, fs: Any, root: str, io_threads: int = 4, rate_limit: float | None = None,
                 direct_io: bool | str = "auto"):
        super().__init__(url, fs, root, io_threads, rate_limit)
        # objects of DIRECT_MIN_BYTES and more bypass the page cache (see write_direct) while
        # ``direct``; "auto" sets it per save (``begin_part``, ``write_mode``)
        self.direct_ok = O_DIRECT is not None and direct_io is not False
        self.auto = direct_io == "auto"
        self.direct = self.direct_ok
        self.modes = WriteModes()
        self.last_flush: tuple[str, str] | None = None    # make_durable's last way and its reason
        self.direct_reads_ok = self.direct_ok               # False with direct_io=False, or once the
        #                                                     filesystem refused a direct read
        self.last_read_mode: tuple[int, str] | None = None  # read_into's last direct reads in flight (0:
        #                                                     the page cache) and why (read_mode)
        self._root_made = False
        self._root_lock = threading.Lock()
        self._unsynced_parents: set[str] = set()   # parents of root levels this store created, not yet fsynced

    def begin_part(self, background: bool) -> dict[str, float]:
        """Pick this part's write path ("auto": ``write_mode.choose_direct``)."""
        if self.auto and self.direct_ok:
            self.direct, _why = self.modes.choose(background)
        return {"direct_io": 1.0 if self.direct else 0.0}

    def end_part(self, nbytes: int, seconds: float, background: bool) -> dict[str, float]:
        """Record the part's write rate on the path it took (sync saves: ``write_mode``) and
        return that path (a filesystem that refused O_DIRECT mid-part took the page cache)."""
        if self.auto and self.direct_ok:
            self.modes.record(self.direct, nbytes, seconds, background)
        return {"direct_io": 1.0 if self.direct else 0.0}

    # -- writes --------------------------------------------------------------------------
    def write(self, key: str, pieces: list, crc: int | None = None) -> None:
        """Write one object from ``pieces`` (``crc`` is for object stores: unused here).
        Objects of ``DIRECT_MIN_BYTES`` and more bypass the page cache (``write_direct``);
        a filesystem that refuses O_DIRECT (EINVAL) gets buffered writes from then on."""
        nbytes = sum(memoryview(p).nbytes for p in pieces)
        self._throttle(nbytes)
        path = self.path(key)
        self._make_root()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.direct and nbytes >= DIRECT_MIN_BYTES:
            try:
                write_direct(path, pieces, nbytes)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = self.direct_ok = False   # this filesystem refuses O_DIRECT: the page cache from now on
        with open(path, "wb") as fh:
            for piece in pieces:
                fh.write(piece)
            fh.flush()
            _start_writeback(fh.fileno())

    def make_durable(self, keys: list[str]) -> None:
        """Flush ``keys`` to the disk, so a commit survives a power cut: ``fdatasync`` each
        file and ``fsync`` each directory from theirs up to the store root (the names of new
        files and directories), or one ``syncfs`` of their filesystem where a rank's part
        has many files and the machine few dirty pages (``flush_mode.choose_syncfs``: syncfs
        also waits for other processes' writes). (A root the store created was flushed in
        its parent then: ``_make_root``.)

        Raises:
            OSError: a flush failed (EIO, ...); a directory fsync that the filesystem does
                not support (EINVAL, ENOTSUP) is skipped.
        """
        if not keys:
            return
        use_syncfs, why = choose_syncfs(len(keys), dirty_bytes(), _syncfs is not None)
        self.last_flush = ("syncfs" if use_syncfs else "fdatasync", why)
        if use_syncfs:
            fd = os.open(os.path.dirname(self.path(keys[0])), os.O_RDONLY)
            try:
                if _syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        paths = [self.path(key) for key in keys]
        for _ in self._pool.map(_fdatasync, paths):
            pass
        for _ in self._pool.map(_fsync_dir, dirs_to_sync(self.root, paths)):
            pass

    def _make_root(self) -> None:
        """Create the store root at the first write and fsync the parent of each directory
        level created for it (their names), once per store, at once: the process that
        creates a root (rank 0's ``begin.json``) need not be the one that flushes the part
        (the writer process). A level another process created is that one's to flush."""
        if self._root_made:
            return
        with self._root_lock:
            if self._root_made:
                return
            self._unsynced_parents.update(os.path.dirname(d) for d in _makedirs_new(self.root))
            for d in sorted(self._unsynced_parents, key=lambda d: (-d.count(os.sep), d)):
                _fsync_dir(d)          # a failure is raised, and the next write tries again
                self._unsynced_parents.discard(d)
            self._root_made = True

    def write_json_atomic(self, key: str, obj: Any) -> None:
        """Write ``obj`` as JSON under a temporary name, fsync it, rename it into place and
        fsync the directory (the rename itself survives a power cut)."""
        data = json_bytes(obj)
        path = self.path(key)
        self._make_root()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    # -- reads ---------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object ``key``."""
        with open(self.path(key), "rb") as fh:
            return fh.read()

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Read [start, end) of each key (``pread`` in the I/O threads); short reads come back
        short (the caller checks)."""
        if not ranges:
            return []
        return list(self._pool.map(lambda r: self._pread(*r), ranges))

    def read_into(self, reqs: Iterable[tuple[str, int, list]],
                  done: Callable[[int, int], None] | None = None) -> list[int]:
        """Scatter-read: fill each request's writable buffers, in order, from ``key`` at ``start``,
        in the I/O threads: where ``read_mode.choose_direct_reads`` says so, ``O_DIRECT`` reads
        through an aligned per-thread buffer copied into them, that many requests (reads and
        ``done``) at once (``_preadv_direct``); else one ``preadv`` per request through the page
        cache straight into them. ``reqs`` may be an iterator: each read starts as soon as it
        yields it (the disk works while the caller plans the rest).
        ``done(i, n)``: called in the I/O thread as soon as request ``i`` is read (``n`` bytes),
        so that its check overlaps the other reads. Every request is over before this returns
        or raises the first failure (in request order). Returns the bytes read per request
        (short at end of object; the caller checks)."""
        in_flight, why = choose_direct_reads(readers_here(), cpus_here(), self.direct_reads_ok)
        self.last_read_mode = (in_flight, why)
        gate = threading.BoundedSemaphore(in_flight) if in_flight else None

        def one(i: int, req: tuple[str, int, list]) -> int:
            with gate or contextlib.nullcontext():      # direct: that many requests at once, checks included
                n = self._preadv(*req) if gate is None else self._preadv_direct(*req)
                if done is not None:
                    done(i, n)
            return n

        return run_all(self._pool, one, reqs)

    def _preadv_direct(self, key: str, start: int, bufs: list) -> int:
        """``_preadv`` around the page cache: ``O_DIRECT`` reads of the aligned span, at most
        ``DIRECT_BOUNCE`` bytes at a time, into a per-thread aligned buffer, each copied into
        ``bufs`` (``read_mode``); a small object, or a range the page cache mostly holds
        already, is read through it (``read_mode.read_through_cache``). A filesystem that
        refuses ``O_DIRECT`` (EINVAL) is read through the page cache from then on."""
        views = [memoryview(b).cast("B") for b in bufs]
        want = sum(v.nbytes for v in views)
        lo = start - start % DIRECT_ALIGN
        end = start + want
        bounce = bounce_buffer()
        got = 0         # bytes of [start, end) copied out
        fd = None
        through_cache = False   # a warm range or a small object; or O_DIRECT refused
        try:
            fd = os.open(self.path(key), os.O_RDONLY | (O_DIRECT or 0) | getattr(os, "O_CLOEXEC", 0))
            through_cache = read_through_cache(resident_pages(fd, start, want), os.fstat(fd).st_size,
                                               DIRECT_MIN_BYTES)[0]
            at = end if through_cache else lo
            while at < end:
                span = direct_cap(-(-(end - at) // DIRECT_ALIGN) * DIRECT_ALIGN)   # a few bytes more: one read
                n = pread_all(fd, bounce[:span], at)
                skip = max(0, start - at)
                useful = min(n, end - at) - skip
                if useful <= 0:
                    break
                scatter(views, at + skip - start, bounce[skip:skip + useful])
                got = at + skip + useful - start
                if n < span:        # the end of the file
                    break
                at += span
        except OSError as exc:      # EINVAL at the open or a read: this filesystem refuses O_DIRECT
            if exc.errno != errno.EINVAL:
                raise
            self.direct_reads_ok = False     # the page cache from now on; it reads every buffer again
            through_cache = True
        finally:
            if fd is not None:
                os.close(fd)
        return self._preadv(key, start, bufs) if through_cache else got

    def _preadv(self, key: str, start: int, bufs: list) -> int:
        views = [memoryview(b).cast("B") for b in bufs]
        fd = os.open(self.path(key), os.O_RDONLY)
        total = 0
        try:
            while views:
                n = os.preadv(fd, views[:_IOV_MAX], start + total)
                if n <= 0:
                    break
                total += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)
        return total

    def _pread(self, key: str, start: int, end: int) -> bytes:
        with open(self.path(key), "rb") as fh:
            return os.pread(fh.fileno(), max(0, end - start), start)

    def exists(self, key: str) -> bool:
        """Does the object ``key`` exist (one stat)?"""
        return os.path.exists(self.path(key))

    def size(self, key: str) -> int:
        """The size of object ``key`` in bytes."""
        return os.path.getsize(self.path(key))

    def object_sizes(self, key: str) -> dict[str, int]:
        """Every file under ``key``, at any depth: {key relative to ``key``: size in bytes}."""
        root = self.path(key)
        out = {}
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                full = os.path.join(dirpath, name)
                out[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        return out

    def list_dir(self, key: str = "") -> list[str]:
        """Names (not paths) of the entries directly under ``key``; [] when absent."""
        try:
            return sorted(os.listdir(self.path(key)))
        except FileNotFoundError:
            return []

    def rename(self, key: str, new_key: str) -> None:
        """Rename a file or directory (atomic)."""
        os.rename(self.path(key), self.path(new_key))

    def delete_prefix(self, key: str) -> None:
        """Delete the file or the directory tree ``key``; nothing if it is absent."""
        try:
            self.fs.rm(self.path(key), recursive=True)
        except FileNotFoundError:
            pass


_SYNC_FILE_RANGE_WRITE = 2
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _sync_file_range: Any = _libc.sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _syncfs: Any = _libc.syncfs
    _syncfs.argtypes = (ctypes.c_int,)
except (OSError, AttributeError):   # not Linux: make_durable flushes file by file
    _sync_file_range = _syncfs = None


def _fdatasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


#: a directory fsync failing with one of these: the filesystem cannot fsync a directory
#: (nothing to flush there); any other error (EIO, ...) is a failed flush and raised
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def _fsync_dir(path: str) -> None:
    """fsync a directory (its entries: the names of new files and directories).

    Raises:
        OSError: it cannot be opened, or its fsync failed other than as unsupported.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _makedirs_new(path: str) -> list[str]:
    """``os.makedirs(path, exist_ok=True)``, returning the levels this call created, top first
    (a level another process creates meanwhile is not listed)."""
    missing = []
    d = os.path.abspath(path)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
            created.append(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
    return created


def _start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages now, from this thread (Linux sync_file_range):
    the disk works while the other objects are written, and the CPU it costs is this
    (possibly niced) thread's rather than the kernel flusher's."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

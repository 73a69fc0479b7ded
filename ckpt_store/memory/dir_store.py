"""One node's memory checkpoints: objects under a directory in host memory (a tmpfs).

The node's transfer server (``server``) serves it to the other nodes, and the node's own
ranks read and write it directly. Keys are relative, "/"-separated, and never leave the
directory. An object appears whole or not at all (written under a temporary name, then
renamed), so a reader never sees a replica that is still arriving.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterable

_IOV_MAX = 512


class DirStore:
    """Objects under ``root`` (created on the first write).

    Args:
        root: the directory (one per node and run, e.g. under /dev/shm).
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._seq = 0
        self._lock = threading.Lock()

    def path(self, key: str) -> str:
        """The file of ``key``; ValueError for a key that would leave the directory."""
        parts = [p for p in key.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"bad object key {key!r}")
        return os.path.join(self.root, *parts) if parts else self.root

    def write(self, key: str, pieces: Iterable) -> None:
        """Write one object from ``pieces`` (buffers), whole or not at all."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with self._lock:
            self._seq += 1
            tmp = f"{path}.part-{os.getpid()}-{threading.get_ident()}-{self._seq}"
        try:
            with open(tmp, "wb") as fh:
                for piece in pieces:
                    fh.write(piece)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def read_range(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of ``key`` (to its end for None); short at the end of the object."""
        with open(self.path(key), "rb") as fh:
            if end is None:
                fh.seek(start)
                return fh.read()
            return os.pread(fh.fileno(), max(0, end - start), start)

    def read_into(self, key: str, start: int, bufs: list) -> int:
        """Fill ``bufs`` in order from ``key`` at ``start``; the bytes read (short at the end)."""
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            views = [memoryview(b).cast("B") for b in bufs]
            want, got = sum(v.nbytes for v in views), 0
            while got < want:
                n = os.preadv(fd, _skip(views, got)[:_IOV_MAX], start + got)
                if n <= 0:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self.path(key))

    def size(self, key: str) -> int:
        return os.stat(self.path(key)).st_size

    def sizes(self, key: str) -> dict[str, int]:
        """Every object under ``key`` at any depth: {key relative to ``key``: size}."""
        top = self.path(key)
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if ".part-" in name:
                    continue     # a replica still arriving
                full = os.path.join(dirpath, name)
                try:
                    out[os.path.relpath(full, top).replace(os.sep, "/")] = os.stat(full).st_size
                except FileNotFoundError:
                    continue
        return out

    def list_dir(self, key: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.path(key)) if ".part-" not in n)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def rename(self, key: str, new_key: str) -> bool:
        """Rename an object or a prefix; False when there is none here."""
        src, dst = self.path(key), self.path(new_key)
        if not os.path.exists(src):
            return False
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        return True

    def delete(self, key: str) -> None:
        """Delete the object or everything under ``key``; nothing if absent."""
        path = self.path(key)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)

    def used_bytes(self) -> int:
        return sum(self.sizes("").values())


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""A filesystem that fills: a size-limited tmpfs to checkpoint onto, and ballast that fills it.

``small_tmpfs(path, size_mb)`` mounts a tmpfs of that size at ``path`` (root only: tests skip
without it) and unmounts it on the way out, also when the test fails (lazily, if a process of
the test still holds a file in it). ``fill(dir)`` writes a ballast file until the filesystem
refuses (ENOSPC) and returns it; deleting it frees the space again. A real filesystem, a real
ENOSPC: nothing is mocked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

#: a ballast write's block
_BLOCK = 1 << 16


def can_mount() -> str | None:
    """Why a tmpfs cannot be mounted here (None: it can): the tests that need one skip with it."""
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root"
    return None


@contextlib.contextmanager
def small_tmpfs(path: str | os.PathLike, size_mb: int) -> Iterator[Path]:
    """Mount a ``size_mb`` MiB tmpfs at ``path`` (created) for the block; unmount it after.

    Raises:
        RuntimeError: the mount failed (names mount's error).
    """
    where = Path(path)
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb)}m,mode=0755", "tmpfs", str(where)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"cannot mount a {size_mb} MiB tmpfs at {where}: {res.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: str | os.PathLike, name: str = "ballast", leave_bytes: int = 0) -> Path:
    """Write ``directory/name`` until the filesystem is full (ENOSPC), less ``leave_bytes``.

    Returns:
        The ballast file (delete it to free the space).
    """
    path = Path(directory) / name
    block = b"\0" * _BLOCK
    written = 0
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                written += fh.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        if leave_bytes:
            fh.truncate(max(0, written - leave_bytes))
    return path


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes a non-root user could still write under ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


__all__ = ["can_mount", "fill", "free_bytes", "small_tmpfs"]

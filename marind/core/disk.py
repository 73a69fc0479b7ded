"""A full filesystem, as every process of marind tells it: the errors that mean it, and free space.

``is_disk_full`` is the one test of "this write failed because the volume (or the user's quota)
is full": ``ENOSPC`` or ``EDQUOT``. ``free_space`` is one look at a filesystem (``statvfs``):
the bytes and inodes the caller may still use (root may use the blocks ext4 reserves for it,
another user may not).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

#: the errors of a write that found its filesystem (or the user's quota) full
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException | None) -> bool:
    """Did this error come from a full filesystem or quota (ENOSPC, EDQUOT)?"""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def error_text(exc: OSError) -> str:
    """``ENOSPC: No space left on device`` (the errno's name, then the system's words)."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{name}: {exc.strerror or exc}"


@dataclass(frozen=True)
class Space:
    """One look at a filesystem: what this process may still use, and its size."""

    free_bytes: int
    total_bytes: int
    free_inodes: int | None = None       # None: the filesystem does not count inodes


def free_space(path: str | os.PathLike) -> Space:
    """``statvfs`` of the filesystem holding ``path``.

    Raises:
        OSError: ``path`` does not exist or cannot be looked at.
    """
    st = os.statvfs(path)
    root = os.geteuid() == 0
    blocks = st.f_bfree if root else st.f_bavail
    inodes = (st.f_ffree if root else st.f_favail) if st.f_files else None
    return Space(free_bytes=blocks * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize, free_inodes=inodes)

"""How much of a file range the page cache holds, asked without reading it (Linux ``cachestat(2)``).

A load's direct reads (``read_mode``) pay off on a cold checkpoint, but one the
page cache holds already (read through it before: by more ranks than cores, by
``verify`` or an export; saved through it: a sync save that took the buffered
path, ``direct_io=False``; copied in with ``cp``) is read far faster from memory
than from the disk. ``cachestat`` (Linux 6.5 and later) counts the resident
pages of a range from the cache's own index: no read, no readahead, nothing
faulted in. Where the kernel lacks it or a sandbox refuses it with an errno
(ENOSYS, EPERM, EACCES), the answer is None and it is not asked again in this
process (a seccomp filter that kills on an unknown call would kill it: the
systemd unit sets none).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from typing import Any

#: cachestat's number: calls added since Linux 5.1 have one number on every architecture
_SYS_CACHESTAT = 451 if sys.platform.startswith("linux") else None
PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_syscall: Any
try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall   # a ctypes call releases the GIL
except (OSError, AttributeError):
    _syscall = None
_works = _syscall is not None and _SYS_CACHESTAT is not None
#: the kernel lacks the call, or a sandbox (seccomp) refuses it
_REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES})


def pages_in(start: int, length: int) -> int:
    """The pages that ``[start, start + length)`` touches."""
    if length <= 0:
        return 0
    return (start + length + PAGE - 1) // PAGE - start // PAGE


def resident_pages(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """(pages of ``[start, start + length)`` in the page cache, pages of it inside the file), or
    None where the kernel cannot tell (no ``cachestat``). Pages past the end of the file are
    never cached, so they are not counted either."""
    global _works
    if not _works or _SYS_CACHESTAT is None:
        return None
    length = min(length, os.fstat(fd).st_size - start)
    if length <= 0:
        return 0, 0
    rng, stat = _Range(start, length), _Stat()
    if _syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(stat),
                ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in _REFUSED:
            _works = False          # not asked again in this process
        return None
    return int(stat.nr_cache), pages_in(start, length)


def available() -> bool:
    """Can this process ask (so far)?"""
    return _works

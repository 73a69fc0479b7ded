"""How much of a file range the page cache holds, asked without reading it (Linux ``cachestat(2)``).

A load's direct reads (``read_mode``) pay off on a cold checkpoint, but one
that is still in the page cache (a restart on the machine that saved it, a
second load, the copy of an export) is read far faster from memory than from
the disk. ``cachestat`` (Linux 6.5 and later) counts the resident pages of a
range from the cache's own index: no read, no readahead, nothing faulted in.
Where the kernel lacks it or a sandbox refuses it (ENOSYS, EPERM), the answer
is None and is not asked again in this process.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform
import threading
from typing import Any

#: cachestat's number in the tables that have it (x86_64's and the generic one of arm64 and riscv)
_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451, "arm64": 451, "riscv64": 451}.get(platform.machine())
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
_lock = threading.Lock()
#: the kernel lacks the call, or a sandbox (seccomp) refuses it
_REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES})


def pages_in(start: int, length: int) -> int:
    """The pages that ``[start, start + length)`` touches."""
    if length <= 0:
        return 0
    return (start + length + PAGE - 1) // PAGE - start // PAGE


def resident_pages(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """(pages of ``[start, start + length)`` in the page cache, pages in the range), or None
    where the kernel cannot tell (no ``cachestat``)."""
    global _works
    if not _works or _SYS_CACHESTAT is None:
        return None
    if length <= 0:
        return 0, 0
    rng, stat = _Range(start, length), _Stat()
    if _syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(stat),
                ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in _REFUSED:
            with _lock:
                _works = False      # not asked again in this process
        return None
    return int(stat.nr_cache), pages_in(start, length)


def available() -> bool:
    """Can this process ask (so far)?"""
    return _works

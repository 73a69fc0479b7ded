"""Tests' and benches' hand on the page cache: drop a file from it, so the next read is from the disk."""

from __future__ import annotations

import os


def drop_from_page_cache(path: str | os.PathLike) -> None:
    """Flush ``path`` and drop its pages from the page cache (``POSIX_FADV_DONTNEED`` drops
    clean pages only, hence the fsync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

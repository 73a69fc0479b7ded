"""Local disks: how a rank's part of a save is made durable, ``syncfs`` or an fsync per file.

Before its done marker a rank flushes what it wrote (``LocalStorage.make_durable``).
``syncfs`` is one call, but it flushes every dirty page of the filesystem: other
processes' too, so on a shared disk it waits for their writes, however long
they take (a save in ``bench/ckpt_scale.py`` once waited far longer than its own
files needed). ``fdatasync`` of each file
the rank wrote, then ``fsync`` of each directory holding one of them and of each
directory above those up to the store root (the names of new files and new
directories are directory data; a root the store creates is flushed in its
parent as it is created: ``LocalStorage._make_root``), flushes only this rank's part,
at a cost that grows with its files. On a quiet disk one ``syncfs`` is the cheaper
at every file count; beside another process's dirty pages it waits for all of
them whatever the count, while the per-file flush stays at its own cost (the
measured figures, and the constants below drawn from them: docs/perf.md,
"Checkpoints: flushing a rank's part").
So a part of at most ``FSYNC_FILES`` files is flushed per file (a little slower
on a quiet disk, never a wait on the others' writes); a larger one per file
too when that is the cheaper by those figures, ``FSYNC_S`` a file against the
machine's dirty pages (Linux ``/proc/meminfo`` Dirty, which leaves out pages
already under writeback, as this rank's are) at ``SYNCFS_BYTES_PER_S``; else
with one ``syncfs``. ``choose_syncfs`` is the pure decision. Neither way
escapes a journal commit that waits for discards of deleted files (on an ext4
mounted with online discard, as on the CI VM): both flushes wait for those.
"""

from __future__ import annotations

import os

FSYNC_FILES = 64                 # at most this many files: fdatasync each (bounded, own cost only)
FSYNC_S = 0.3e-3                 # a file's fdatasync and its share of directory fsyncs (measured: docs/perf.md)
SYNCFS_BYTES_PER_S = 2e9         # how fast syncfs got through another process's dirty pages (docs/perf.md)


def choose_syncfs(files: int, dirty_bytes: int | None, have_syncfs: bool) -> tuple[bool, str]:
    """Whether to flush a rank's ``files`` written files with one ``syncfs``, and why.

    Args:
        files: how many files the rank wrote (and must flush).
        dirty_bytes: the machine's dirty page-cache bytes not yet under writeback
            (None: unknown).
        have_syncfs: the platform has ``syncfs`` (Linux).

    Returns:
        (syncfs?, the reason); False: ``fdatasync`` each file and ``fsync`` its directories.
    """
    if not have_syncfs:
        return False, "no syncfs on this platform"
    if files <= FSYNC_FILES:
        return False, f"{files} files <= {FSYNC_FILES}: per-file flushes cost a few ms and wait for no one else"
    own, others = files * FSYNC_S, (dirty_bytes or 0) / SYNCFS_BYTES_PER_S
    if own < others:
        return False, (f"{(dirty_bytes or 0) >> 20} MiB of dirty pages on the machine: syncfs would wait "
                       f"~{others:.2f} s for them, {files} per-file flushes ~{own:.2f} s")
    return True, f"{files} files (~{own:.2f} s per file): one syncfs costs less"


def dirty_bytes() -> int | None:
    """The machine's dirty page-cache bytes not yet under writeback (``/proc/meminfo``
    Dirty); None where that cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"Dirty:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def dirs_to_sync(root: str, paths: list[str]) -> list[str]:
    """The directories whose entries make ``paths`` (files under ``root``) findable after a
    power cut: each file's directory and every directory above it up to ``root`` itself.

    Args:
        root: the store root (its own entry in its parent, and those of any directories
            above it created with it, were flushed as it was made: ``LocalStorage._make_root``).
        paths: the written files, absolute.

    Returns:
        The directories, sorted deepest first (each at most once).
    """
    top = os.path.normpath(root)
    out: set[str] = set()
    for p in paths:
        d = os.path.dirname(os.path.normpath(p))
        while d not in out and (d == top or d.startswith(top + os.sep)):
            out.add(d)
            d = os.path.dirname(d)
    return sorted(out, key=lambda d: (-d.count(os.sep), d))

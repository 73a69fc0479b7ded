"""Local disks: O_DIRECT I/O through one page-aligned staging buffer per thread.

A direct write or read needs its buffer address, length and file offset aligned to the
device's block (``DIRECT_ALIGN``); chunk objects are any size and their pieces live in
arbitrary memory, so each is staged through this thread's aligned buffer
(``DIRECT_BOUNCE`` bytes, plus ``DIRECT_SLACK`` for a short tail), the last block
zero-padded and the file truncated back. ``LocalStorage`` decides when to go direct
(``local_disk``, ``write_mode``, ``read_mode``); this module only moves the bytes.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

O_DIRECT = getattr(os, "O_DIRECT", None)
DIRECT_ALIGN = 4096                 # O_DIRECT: buffer address, length and file offset multiples
DIRECT_BOUNCE = 4 * 2**20           # per-thread aligned staging buffer (plus DIRECT_SLACK)
#: an object's last bytes past a full buffer go with it when they are this few (one write,
#: one allocation): a chunk object is its data plus a few bytes of crc32c and shard index,
#: and a tail written on its own got blocks of its own, often elsewhere on the disk (more
#: extents per object, and more device reads in a load: docs/perf.md)
DIRECT_SLACK = 64 * 2**10
DIRECT_MIN_BYTES = 256 * 2**10      # smaller objects: the page cache (metadata, markers, values)
_bounce = threading.local()


def write_direct(path: str, pieces: list, nbytes: int) -> None:
    """Write ``pieces`` to ``path`` with O_DIRECT, through a page-aligned per-thread buffer
    (``DIRECT_BOUNCE`` bytes a write; a tail of at most ``DIRECT_SLACK`` goes with the last).

    Buffered writes of a checkpoint cost the machine several times what the
    copy does: page-cache allocation, dirty tracking and the kernel flusher's
    writeback all run beside training: beside busy processes, buffered writes
    (with sync_file_range and syncfs) took several times as long as O_DIRECT ones
    and slowed those processes more. Sync saves come here too: with nothing
    beside them buffered writes are sometimes as fast, but on a VM whose free
    pages go back to the host (virtio-balloon free page reporting) every fresh
    page-cache page is a fault to the host, and the same writes were then often
    much slower, where direct writes held steady (figures: docs/perf.md,
    "Checkpoints: write path"). The last block is zero-padded to the alignment and the file then
    truncated to ``nbytes``. Durability still needs ``make_durable`` (the
    file's size and extents are metadata).
    """
    view = bounce_buffer()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT or 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fill = flushed = 0
        cap = direct_cap(nbytes)
        for piece in pieces:
            src = memoryview(piece).cast("B")
            at = 0
            while at < src.nbytes:
                n = min(cap - fill, src.nbytes - at)
                view[fill:fill + n] = src[at:at + n]
                fill += n
                at += n
                if fill == cap and flushed + fill < nbytes:     # a full buffer, and more to come
                    write_all(fd, view[:fill])
                    flushed += fill
                    fill = 0
                    cap = direct_cap(nbytes - flushed)
        if fill:
            padded = -(-fill // DIRECT_ALIGN) * DIRECT_ALIGN
            view[fill:padded] = bytes(padded - fill)
            write_all(fd, view[:padded])
            if padded != fill:
                os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)


def bounce_buffer() -> memoryview:
    """This thread's page-aligned staging buffer for direct I/O (``DIRECT_BOUNCE`` plus
    ``DIRECT_SLACK`` bytes; shared by its direct writes and reads, which never overlap)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, DIRECT_BOUNCE + DIRECT_SLACK)     # anonymous mmap: page-aligned
    return memoryview(buf)


def pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Direct-read into ``view`` from ``offset`` until it is full or the file ends; the bytes
    read. A read that stops short of an aligned end is the end of the file: reading on from
    there would be a misaligned direct read (EINVAL on some kernels)."""
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
        if got % DIRECT_ALIGN:
            break
    return got


def scatter(views: list[memoryview], pos: int, src: memoryview) -> None:
    """Copy ``src`` into the concatenation of ``views`` from byte ``pos`` on (numpy's copy
    leaves the GIL to the other I/O threads)."""
    at = 0
    for v in views:
        if pos >= v.nbytes:
            pos -= v.nbytes
            continue
        n = min(v.nbytes - pos, src.nbytes - at)
        np.copyto(np.frombuffer(v, dtype=np.uint8, count=n, offset=pos),
                  np.frombuffer(src, dtype=np.uint8, count=n, offset=at))
        at += n
        pos = 0
        if at == src.nbytes:
            return


def direct_cap(rest: int) -> int:
    """How much of an object's ``rest`` bytes the next direct write takes: a full buffer, or
    all of them where they fit in one with its slack (``DIRECT_SLACK``)."""
    return DIRECT_BOUNCE if rest > DIRECT_BOUNCE + DIRECT_SLACK else rest


def write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]

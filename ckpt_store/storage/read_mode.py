"""Local disks: which path a load's chunk reads take, chosen from the machine's CPUs per reader.

A cold load reads each chunk object once. Through the page cache, every 4 KiB
page of it is allocated, filled by the disk and copied out, and the objects are
separate files of a few MiB, so the readahead that streams a large file never
gets going. ``O_DIRECT`` reads skip all of that: the disk fills an aligned
buffer that is copied into the target (a chunk's crc32c sits between its
blocks, so the target itself cannot be the buffer). In the bench's cold loads
direct reads were the faster where each loading rank had a core of its own, and
fastest with two reads in flight per rank (of 1, 2 and 4 tried); with more
loading processes than cores the copy competes with the other ranks for the
CPU, and the page cache was the faster (figures: docs/perf.md, "Checkpoints:
loads"). So a load reads direct
where each rank reading on this machine has a core of its own (the machine's
CPUs: ``LOCAL_WORLD_SIZE`` counts the machine's ranks, and a rank pinned to one
core still shares the machine), each rank keeping ``DIRECT_IN_FLIGHT`` divided
by the machine's readers (at least one) requests in flight, a request's check
included; through the page cache otherwise.

A direct read skips the page cache even where it holds the chunk, and then goes
to the disk for bytes that are in memory (``page_cache`` lists when a checkpoint
is there). So each request first asks the cache how much of its range it holds
(``page_cache``, reading nothing) and reads through it when that is at least
``CACHED_ENOUGH`` of the range. Objects under ``DIRECT_MIN_BYTES`` are read
through it whatever the answer: they are written through it (``local_disk``),
and where the kernel cannot be asked, a disk round trip for each of them would
cost more than the copy saves.
"""

from __future__ import annotations

import os

#: a request with at least this share of its pages in the page cache is read through it
CACHED_ENOUGH = 0.5
#: direct reads in flight on one machine (all its reading ranks together): the bench's best,
#: two per rank with two ranks (docs/perf.md); each rank gets at least one
DIRECT_IN_FLIGHT = 4


def choose_direct_reads(readers_here: int, cpus: int, direct_ok: bool = True) -> tuple[int, str]:
    """How many direct reads this rank keeps in flight, 0 for the page cache, and why.

    Args:
        readers_here: ranks loading on this machine at once (``LOCAL_WORLD_SIZE``).
        cpus: CPUs this process may run on.
        direct_ok: the filesystem takes ``O_DIRECT`` (False after a refusal).
    """
    if not direct_ok:
        return 0, "O_DIRECT is off here (direct_io=False, or the filesystem refused it)"
    readers = max(1, readers_here)
    if readers > cpus:
        return 0, f"{readers} ranks read on {cpus} CPUs: the copy out of a direct read would compete for them"
    return max(1, DIRECT_IN_FLIGHT // readers), f"{readers} ranks read on {cpus} CPUs: a core each"


def read_through_cache(resident: tuple[int, int] | None, object_bytes: int, small: int) -> tuple[bool, str]:
    """Whether a request that ``choose_direct_reads`` sends around the page cache goes through
    it after all, and why.

    Args:
        resident: (pages of its range in the page cache, pages of the range inside the object)
            (``page_cache.resident_pages``), or None where the kernel cannot tell.
        object_bytes: the size of the object it reads from.
        small: objects under this many bytes are read through the page cache: they were
            written through it (``direct_io.DIRECT_MIN_BYTES``) and likely sit in it still.
    """
    if object_bytes < small:
        return True, f"a {object_bytes}-byte object: under {small}, written through the page cache"
    if resident is None:
        return False, "the page cache cannot be asked here: direct"
    held, pages = resident
    if pages and held >= CACHED_ENOUGH * pages:
        return True, f"the page cache holds {held} of its {pages} pages"
    return False, f"the page cache holds {held} of its {pages} pages: direct"


def readers_here() -> int:
    """The ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def cpus_here() -> int:
    """This machine's CPUs (the ranks of ``readers_here`` are the machine's too)."""
    return os.cpu_count() or 1

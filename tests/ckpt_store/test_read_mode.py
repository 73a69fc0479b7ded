"""A load's chunk reads go around the page cache where each reading rank has a core (``read_mode``).

The choice is pure; the direct path is checked on the real local disk against the page
cache's, byte for byte: unaligned starts, several buffers per request, requests longer
than the aligned staging buffer, and a request past the end of its object (read short).
"""

from __future__ import annotations

import os

import fsspec
import pytest

from ckpt_store.page_cache import PAGE, pages_in, resident_pages
from ckpt_store.read_mode import DIRECT_IN_FLIGHT, choose_direct_reads, cpus_here, read_through_cache
from ckpt_store.storage_local import DIRECT_BOUNCE, DIRECT_MIN_BYTES, LocalStorage


@pytest.mark.unit
@pytest.mark.parametrize("readers, cpus, want", [
    (1, 2, DIRECT_IN_FLIGHT),          # alone: every read in flight is its own
    (2, 2, DIRECT_IN_FLIGHT // 2),     # the reshard bench: 2 ranks on the 2-core VM
    (0, 2, DIRECT_IN_FLIGHT),          # no LOCAL_WORLD_SIZE: one reader
    (8, 64, 1),                        # a GPU node: at least one each
    (4, 2, 0),                         # more readers than cores: the page cache
])
def test_direct_reads_where_each_reader_has_a_core(readers, cpus, want):
    in_flight, why = choose_direct_reads(readers, cpus)
    assert in_flight == want, why
    assert f"on {cpus} CPUs" in why


@pytest.mark.unit
def test_a_filesystem_that_refused_o_direct_reads_through_the_page_cache():
    in_flight, why = choose_direct_reads(1, 8, direct_ok=False)
    assert in_flight == 0 and "O_DIRECT is off" in why


def _requests(size: int) -> list[tuple[int, list[int]]]:
    """(start, buffer sizes) of reads into an object of ``size`` bytes."""
    return [
        (0, [size]),                                   # the whole object, one buffer
        (4097, [1_000_000, 4, 3_000_000, 4]),          # unaligned, scattered like data + crc32c
        (1, [DIRECT_BOUNCE + 70_000]),                 # longer than the staging buffer
        (size - 84, [80, 4]),                          # the tail alone (small: the page cache)
        (size - DIRECT_MIN_BYTES, [DIRECT_MIN_BYTES - 4, 4]),   # the tail alone, direct
        (size - 100, [300]),                           # past the end: read short (small)
        (size - 100, [DIRECT_MIN_BYTES]),              # past the end: read short
        (size + 10, [DIRECT_MIN_BYTES]),               # wholly past the end: nothing
        (size - DIRECT_BOUNCE - 100_000, [DIRECT_BOUNCE + 200_000]),   # two reads, the second short
    ]


@pytest.mark.parametrize("readers", ["1", "many"])
def test_direct_and_buffered_reads_fill_the_same_bytes(tmp_path, monkeypatch, readers):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1" if readers == "1" else str(cpus_here() + 1))
    size = 2 * DIRECT_BOUNCE + 84
    data = os.urandom(size)
    st = LocalStorage(f"file://{tmp_path}", fsspec.filesystem("file"), str(tmp_path), io_threads=3)
    try:
        st.write("obj", [data])
        reqs = [("obj", start, [bytearray(n) for n in sizes]) for start, sizes in _requests(size)]
        got = st.read_into(reqs)
        assert (st.last_read_mode[0] > 0) == (readers == "1"), st.last_read_mode
        if readers == "1" and not st.direct_reads_ok:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: only the page cache was read")
        for (_key, start, bufs), n in zip(reqs, got):
            want = data[start:start + sum(len(b) for b in bufs)]
            assert n == len(want), (start, n)
            assert b"".join(bytes(b) for b in bufs)[:n] == want, start
    finally:
        st.close()


@pytest.mark.unit
@pytest.mark.parametrize("resident, cached", [
    (None, False),          # the kernel cannot tell: direct, as chosen
    ((0, 1025), False),     # cold
    ((512, 1025), False),   # under half
    ((513, 1025), True),    # half or more: memory beats the disk
    ((1025, 1025), True),
    ((0, 0), False),        # an empty range
])
def test_a_range_mostly_in_the_page_cache_is_read_through_it(resident, cached):
    through, why = read_through_cache(resident, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES)
    assert through == cached, why


@pytest.mark.unit
@pytest.mark.parametrize("nbytes, cached", [(0, True), (DIRECT_MIN_BYTES - 1, True), (DIRECT_MIN_BYTES, False)])
def test_a_small_request_is_read_through_the_page_cache(nbytes, cached):
    through, why = read_through_cache((0, 64), nbytes, DIRECT_MIN_BYTES)
    assert through == cached, why


@pytest.mark.unit
@pytest.mark.parametrize("start, length, pages", [
    (0, 0, 0), (0, 1, 1), (0, PAGE, 1), (1, PAGE, 2), (PAGE - 1, 2, 2), (3 * PAGE, 5 * PAGE + 84, 6)])
def test_pages_a_range_touches(start, length, pages):
    assert pages_in(start, length) == pages


class _CountingStorage(LocalStorage):
    """Counts the requests read through the page cache (``_preadv``)."""

    buffered = 0

    def _preadv(self, key, start, bufs):
        self.buffered += 1
        return super()._preadv(key, start, bufs)


def test_a_direct_load_reads_a_range_the_page_cache_holds_through_it(tmp_path, monkeypatch):
    """Cold, the reads go around the page cache; with the object in memory, through it."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    size = 2 * DIRECT_BOUNCE + 84
    data = os.urandom(size)
    path = tmp_path / "obj"
    path.write_bytes(data)              # buffered: in the page cache
    st = _CountingStorage(f"file://{tmp_path}", fsspec.filesystem("file"), str(tmp_path), io_threads=2)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            warm = resident_pages(fd, 0, size)
            if warm is None:
                pytest.skip("this kernel has no cachestat(2) (Linux 6.5+), or a sandbox refuses it")
            assert warm == (pages_in(0, size), pages_in(0, size))
            reqs = lambda: [("obj", 0, [bytearray(DIRECT_BOUNCE)]), ("obj", DIRECT_BOUNCE, [bytearray(size)])]
            warm_reqs = reqs()
            assert st.read_into(warm_reqs) == [DIRECT_BOUNCE, size - DIRECT_BOUNCE] and st.last_read_mode[0] > 0
            assert st.buffered == 2 and bytes(warm_reqs[0][2][0]) == data[:DIRECT_BOUNCE]
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)      # drop it: cold
            if resident_pages(fd, 0, size)[0] > pages_in(0, size) // 4:
                pytest.skip("the kernel kept the dropped pages in the page cache")
        finally:
            os.close(fd)
        cold_reqs = reqs()
        assert st.read_into(cold_reqs) == [DIRECT_BOUNCE, size - DIRECT_BOUNCE]
        if not st.direct_reads_ok:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        assert st.buffered == 2, "a cold range went through the page cache"
        assert bytes(cold_reqs[1][2][0])[:size - DIRECT_BOUNCE] == data[DIRECT_BOUNCE:]
    finally:
        st.close()

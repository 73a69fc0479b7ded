"""A load's chunk reads go around the page cache where each reading rank has a core (``read_mode``).

The choice is pure; the direct path is checked on the real local disk against the page
cache's, byte for byte: unaligned starts, several buffers per request, requests longer
than the aligned staging buffer, and a request past the end of its object (read short).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import fsspec
import pytest

from ckpt_store.storage import page_cache
from ckpt_store.storage.direct_io import DIRECT_BOUNCE, DIRECT_MIN_BYTES
from ckpt_store.storage.local_disk import LocalStorage
from ckpt_store.storage.page_cache import PAGE, pages_in, resident_pages
from ckpt_store.storage.read_mode import DIRECT_IN_FLIGHT, choose_direct_reads, cpus_here, read_through_cache
from marind.testing.page_cache import drop_from_page_cache


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
        (size - 84, [80, 4]),                          # the tail alone
        (size - 100, [300]),                           # past the end: read short
        (size + 10, [8]),                              # wholly past the end: nothing
        (size - DIRECT_BOUNCE - 100_000, [DIRECT_BOUNCE + 200_000]),   # two reads, the second short
    ]


class _CountingStorage(LocalStorage):
    """Counts the requests read through the page cache (``_preadv``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffered = 0
        self._count_lock = threading.Lock()

    def _preadv(self, key, start, bufs):
        with self._count_lock:
            self.buffered += 1
        return super()._preadv(key, start, bufs)


def _storage(tmp_path) -> _CountingStorage:
    return _CountingStorage(f"file://{tmp_path}", fsspec.filesystem("file"), str(tmp_path), io_threads=3)


def _cached_pages(path) -> tuple[int, int] | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_pages(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("readers", ["1", "many"])
def test_direct_and_buffered_reads_fill_the_same_bytes(tmp_path, monkeypatch, readers):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1" if readers == "1" else str(cpus_here() + 1))
    size = 2 * DIRECT_BOUNCE + 84
    data = os.urandom(size)
    st = _storage(tmp_path)
    try:
        st.write("obj", [data])
        drop_from_page_cache(tmp_path / "obj")         # the direct write's zero-padded last page went through the cache
        if readers == "1" and (_cached_pages(tmp_path / "obj") or (0, 0))[0]:
            pytest.skip(f"{tmp_path}'s filesystem keeps its files in memory: no direct read to test")
        reqs = [("obj", start, [bytearray(n) for n in sizes]) for start, sizes in _requests(size)]
        got = st.read_into(reqs)
        assert (st.last_read_mode[0] > 0) == (readers == "1"), st.last_read_mode
        if readers == "1" and not st.direct_reads_ok:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: only the page cache was read")
        assert st.buffered == (0 if readers == "1" else len(reqs)), "the path taken"
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
    ((0, 0), False),        # nothing of the range inside the object
])
def test_a_range_mostly_in_the_page_cache_is_read_through_it(resident, cached):
    through, why = read_through_cache(resident, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES)
    assert through == cached, why


@pytest.mark.unit
@pytest.mark.parametrize("object_bytes, cached", [(0, True), (DIRECT_MIN_BYTES - 1, True), (DIRECT_MIN_BYTES, False)])
def test_a_small_object_is_read_through_the_page_cache(object_bytes, cached):
    through, why = read_through_cache((0, 64), object_bytes, DIRECT_MIN_BYTES)
    assert through == cached, why


@pytest.mark.unit
@pytest.mark.parametrize("start, length, pages", [
    (0, 0, 0), (0, 1, 1), (0, PAGE, 1), (1, PAGE, 2), (PAGE - 1, 2, 2), (3 * PAGE, 5 * PAGE + 84, 6)])
def test_pages_a_range_touches(start, length, pages):
    assert pages_in(start, length) == pages


def test_a_direct_load_reads_a_range_the_page_cache_holds_through_it(tmp_path, monkeypatch):
    """Cold, the reads go around the page cache; with the object in memory, through it."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    size = 2 * DIRECT_BOUNCE + 84
    data = os.urandom(size)
    path = tmp_path / "obj"
    path.write_bytes(data)              # buffered: in the page cache
    warm = _cached_pages(path)
    if warm is None:
        pytest.skip("this kernel has no cachestat(2) (Linux 6.5+), or a sandbox refuses it")
    if warm != (pages_in(0, size), pages_in(0, size)):
        pytest.skip(f"the page cache kept {warm[0]} of the {warm[1]} pages just written (memory pressure)")
    tail = size - DIRECT_BOUNCE

    def reqs():
        return [("obj", 0, [bytearray(DIRECT_BOUNCE)]), ("obj", DIRECT_BOUNCE, [bytearray(tail)])]

    def check(done, got):
        assert got == [DIRECT_BOUNCE, tail]
        assert bytes(done[0][2][0]) == data[:DIRECT_BOUNCE] and bytes(done[1][2][0]) == data[DIRECT_BOUNCE:]

    st = _storage(tmp_path)
    try:
        warm_reqs = reqs()
        check(warm_reqs, st.read_into(warm_reqs))
        assert st.last_read_mode[0] > 0 and st.buffered == 2, "a range in memory was read from the disk"
        drop_from_page_cache(path)
        if _cached_pages(path)[0] > pages_in(0, size) // 4:
            pytest.skip("the kernel kept the dropped pages in the page cache")
        cold_reqs = reqs()
        check(cold_reqs, st.read_into(cold_reqs))
        if not st.direct_reads_ok:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        assert st.buffered == 2, "a cold range went through the page cache"
    finally:
        st.close()


def test_a_small_object_is_read_through_the_page_cache_even_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    data = os.urandom(DIRECT_MIN_BYTES - 1)
    (tmp_path / "small").write_bytes(data)
    drop_from_page_cache(tmp_path / "small")
    st = _storage(tmp_path)
    try:
        reqs = [("small", 10, [bytearray(1000)])]
        assert st.read_into(reqs) == [1000] and bytes(reqs[0][2][0]) == data[10:1010]
        assert st.last_read_mode[0] > 0 and st.buffered == 1
    finally:
        st.close()


@pytest.mark.unit
def test_pages_past_the_end_of_the_file_are_not_counted(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (3 * PAGE + 5))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = resident_pages(fd, PAGE, 100 * PAGE)
        if got is None:
            pytest.skip("this kernel has no cachestat(2) (Linux 6.5+), or a sandbox refuses it")
        assert got[1] == 3 and resident_pages(fd, 10 * PAGE, PAGE) == (0, 0)
    finally:
        os.close(fd)


@pytest.mark.unit
@pytest.mark.parametrize("err, still_asked", [(errno.ENOSYS, False), (errno.EPERM, False), (errno.EBADF, True)])
def test_a_refused_cachestat_is_not_asked_again(monkeypatch, tmp_path, err, still_asked):
    """A kernel without the call, or a sandbox that refuses it, answers None from then on;
    any other failure answers None for that call only."""
    calls = []

    def refuse(*args):
        calls.append(args)
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(page_cache, "_syscall", refuse)
    monkeypatch.setattr(page_cache, "_works", True)
    monkeypatch.setattr(page_cache, "_SYS_CACHESTAT", 451)
    (tmp_path / "f").write_bytes(b"x" * 10)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert resident_pages(fd, 0, 10) is None
        assert page_cache.available() == still_asked
        assert resident_pages(fd, 0, 10) is None and len(calls) == (2 if still_asked else 1)
    finally:
        os.close(fd)

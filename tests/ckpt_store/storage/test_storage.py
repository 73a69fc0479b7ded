"""The storage backends: the local-disk write path (O_DIRECT objects, exact bytes, no page cache)
and the S3 checksum headers."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from ckpt_store.storage import direct_io
from ckpt_store.storage.direct_io import DIRECT_ALIGN, DIRECT_BOUNCE, DIRECT_MIN_BYTES, DIRECT_SLACK
from ckpt_store.storage.object_store import S3_RETRIES, s3_defaults
from ckpt_store.storage.protocol import open_storage

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore over a read-only mapping, which reads nothing)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            assert _libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(v & 1 for v in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


SIZES = [DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, DIRECT_BOUNCE, DIRECT_BOUNCE + DIRECT_ALIGN - 1,
         2 * DIRECT_BOUNCE + 3, DIRECT_BOUNCE + DIRECT_SLACK, DIRECT_BOUNCE + DIRECT_SLACK + 1,
         2 * DIRECT_BOUNCE]


@pytest.mark.unit
@pytest.mark.parametrize("nbytes", SIZES)
def test_large_objects_round_trip_exactly_past_the_page_cache(tmp_path, nbytes):
    st = open_storage(str(tmp_path))
    data = os.urandom(nbytes)
    cut = [0, 7, nbytes // 3, nbytes - 4, nbytes]          # unaligned pieces, as encode_chunk makes them
    st.write("a/obj", [memoryview(data)[lo:hi] for lo, hi in zip(cut, cut[1:])])
    if not st.direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: the buffered path is what runs there")
    path = tmp_path / "a" / "obj"
    assert os.path.getsize(path) == nbytes
    assert resident_pages(path) == 0, "a direct write left the object in the page cache"
    assert st.read("a/obj") == data


@pytest.mark.unit
@pytest.mark.parametrize(("nbytes", "writes"), [
    (DIRECT_BOUNCE + 84, [DIRECT_BOUNCE + DIRECT_ALIGN]),           # a chunk object: data + crcs + index
    (2 * DIRECT_BOUNCE + 84, [DIRECT_BOUNCE, DIRECT_BOUNCE + DIRECT_ALIGN]),
    (DIRECT_BOUNCE + DIRECT_SLACK + 1, [DIRECT_BOUNCE, DIRECT_SLACK + DIRECT_ALIGN]),
    (2 * DIRECT_BOUNCE, [DIRECT_BOUNCE, DIRECT_BOUNCE])])
def test_a_short_tail_goes_with_the_last_full_direct_write(tmp_path, monkeypatch, nbytes, writes):
    """A tail of at most ``DIRECT_SLACK`` bytes past a full buffer is written with it (one
    write, so one allocation: a tail written alone got blocks of its own, often elsewhere)."""
    st = open_storage(str(tmp_path))
    if not st.direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: the buffered path is what runs there")
    sizes: list[int] = []
    real = direct_io.write_all

    def counted(fd, view):
        sizes.append(view.nbytes)
        real(fd, view)
    monkeypatch.setattr(direct_io, "write_all", counted)
    data = os.urandom(nbytes)
    st.write("a/obj", [memoryview(data)[:nbytes - 84], memoryview(data)[nbytes - 84:]])
    assert sizes == writes
    assert os.path.getsize(tmp_path / "a" / "obj") == nbytes and st.read("a/obj") == data


@pytest.mark.unit
def test_small_objects_and_direct_io_off_use_the_page_cache(tmp_path):
    st = open_storage(str(tmp_path), direct_io=False)
    data = os.urandom(DIRECT_BOUNCE + 5)
    st.write("big", [data])
    assert resident_pages(tmp_path / "big") > 0 and st.read("big") == data
    small = os.urandom(DIRECT_MIN_BYTES - 1)
    open_storage(str(tmp_path)).write("small", [small])
    assert resident_pages(tmp_path / "small") > 0 and (tmp_path / "small").read_bytes() == small


@pytest.mark.unit
def test_a_failed_direct_write_leaves_no_object(tmp_path):
    st = open_storage(str(tmp_path))
    strided = memoryview(os.urandom(64))[::2]          # has a size, but cannot be copied as bytes
    with pytest.raises(TypeError):
        st.write("x/obj", [os.urandom(DIRECT_BOUNCE + DIRECT_MIN_BYTES), strided])
    assert not (tmp_path / "x" / "obj").exists()


def test_s3_checks_each_upload_against_the_writers_crc32c(s3, s3_url):
    """The crc32c computed from the snapshot goes with the PUT: the server refuses a body that
    does not match it, and nothing is stored."""
    import crc32c

    st = open_storage(s3_url, s3.storage_options)
    assert st.s3
    st.write("probe", [b"x"])                       # connects the client
    sent: list[dict] = []
    st.fs.s3.meta.events.register("before-send.s3.PutObject",
                                  lambda request, **_: sent.append(dict(request.headers)))
    data = os.urandom(100_000)
    st.write("ok/obj", [data[:10], data[10:]], crc=crc32c.crc32c(data))
    assert st.read("ok/obj") == data
    with pytest.raises(OSError):
        st.write("bad/obj", [data], crc=crc32c.crc32c(data) ^ 1)
    assert not st.exists("bad/obj")
    # the crc32c, not a SHA-256 of the body, is what guards it (see s3_defaults)
    assert len(sent) >= 2 and {h.get("X-Amz-Content-SHA256") for h in sent} == {b"UNSIGNED-PAYLOAD"}, sent
    assert all("x-amz-checksum-crc32c" in {k.lower() for k in h} for h in sent)


@pytest.mark.unit
def test_s3_defaults_leave_other_options_and_an_explicit_choice_alone(monkeypatch):
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    user = {"key": "k", "config_kwargs": {"retries": {"max_attempts": 1}, "s3": {"addressing_style": "path"}}}
    got = s3_defaults("s3://b/p", user)
    assert got["config_kwargs"] == {"retries": {"max_attempts": 1},
                                    "s3": {"addressing_style": "path", "payload_signing_enabled": False}}
    assert user["config_kwargs"]["s3"] == {"addressing_style": "path"}, "the caller's dict is not changed"
    signed = {"config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    got = s3_defaults("s3://b", signed)
    assert got["config_kwargs"]["s3"] == {"payload_signing_enabled": True}, "an explicit choice stays"
    assert got["config_kwargs"]["retries"] == S3_RETRIES                      # and the retry budget is filled in
    assert s3_defaults("file:///x", None) == {} and s3_defaults("memory://x", {"a": 1}) == {"a": 1}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")                              # botocore's own variable wins
    assert s3_defaults("s3://b", None)["config_kwargs"]["retries"] == {"mode": "standard"}

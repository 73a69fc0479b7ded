"""The load's reads (issue 21): each read is checked as soon as it is over, in its I/O thread,
not after every read; on a local disk a large chunk object is read in several reads (``READ_GROUP_BYTES``
each, so they spread over the I/O threads); a bad inner chunk is
still ``CheckpointCorrupt`` naming it, raised once every read is over. Real local files;
the storage is the real ``LocalStorage`` with its reads logged."""

from __future__ import annotations

import json
import os
import threading

import crc32c
import fsspec
import pytest
import torch

from ckpt_store import CheckpointCorrupt, CheckpointStore
from ckpt_store.format.manifest import FORMAT
from ckpt_store.format.steps import BEGIN_MARKER
from ckpt_store.format.zarr_format import (
    ArraySpec,
    array_metadata,
    chunk_key,
    decode_index,
    encode_chunk,
    index_nbytes,
    predicted_index,
)
from ckpt_store.load import loader
from ckpt_store.load.loader import load_step
from ckpt_store.save.commit import commit
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.rank_part import write_rank_part
from ckpt_store.storage.local_disk import LocalStorage
from ckpt_store.storage.protocol import open_storage

D1 = "step-0000000001"


#: where the shard index starts in ``_saved``'s object: 16 inner chunks of 16 KiB + crc32c
INDEX_AT = 16 * (16 * 1024 + 4)


class LoggedStorage(LocalStorage):
    """The real local backend with one I/O thread; logs every read and the thread it ran on,
    and the keys of ``read_ranges`` calls (a round of reads before the data's)."""

    def __init__(self, root: str):
        super().__init__(f"file://{root}", fsspec.filesystem("file"), root, io_threads=1)
        self.events: list[tuple] = []
        self.ranged: list[str] = []

    def read_ranges(self, reqs):
        self.ranged += [r[0] for r in reqs]
        return super().read_ranges(reqs)

    def _preadv(self, key, start, bufs):
        n = super()._preadv(key, start, bufs)
        self.events.append(("read", key, start, n, threading.current_thread().name))
        return n

    def _preadv_direct(self, key, start, bufs):     # a load's reads around the page cache (read_mode)
        logged = len(self.events)
        n = super()._preadv_direct(key, start, bufs)
        if len(self.events) == logged:              # not already logged by a fallback to _preadv
            self.events.append(("read", key, start, n, threading.current_thread().name))
        return n


def _saved(tmp_path) -> tuple[str, torch.Tensor]:
    root = str(tmp_path / "ckpt")
    w = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    store = CheckpointStore(f"file://{root}", inner_chunk_bytes=16 * 1024, writer="thread")
    store.save(1, {"model": {"w": w}}, async_=False)     # 16 inner chunks of 4 rows (16 KiB) in one object
    store.close()
    return root, w


def _logged_checks(monkeypatch, st: LoggedStorage) -> None:
    real = loader._Block.check

    def check(blk):
        out = real(blk)
        st.events.append(("check", blk.key, blk.offset, threading.current_thread().name))
        return out
    monkeypatch.setattr(loader._Block, "check", check)


def test_each_read_is_checked_as_soon_as_it_is_over(tmp_path, monkeypatch):
    root, w = _saved(tmp_path)
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 64 * 1024)
    st = LoggedStorage(root)
    _logged_checks(monkeypatch, st)
    target = {"model": {"w": torch.zeros(64, 1024)}}
    stats = load_step(st, D1, target, 0)
    st.close()
    assert torch.equal(target["model"]["w"], w)
    reads = [e for e in st.events if e[0] == "read" and "/c/" in e[1] and e[2] < INDEX_AT]
    checks = [e for e in st.events if e[0] == "check"]
    assert len(checks) == 16
    assert len(reads) == 6 and all(e[3] <= 64 * 1024 for e in reads), reads   # 3 + 3 + 3 + 3 + 3 + 1 inner chunks
    assert stats["objects"] == len(reads)
    # the shard index (known from the object's size) is read by the read of the data that ends
    # where it starts: one read per run of the object, not a round of index reads before the data,
    # nor a read of its own
    size = os.path.getsize(f"{root}/{D1}/model/w/c/0/0")
    assert [e[2] for e in st.events if e[0] == "read" and "/c/" in e[1] and e[2] >= INDEX_AT] == []
    assert reads[-1][2] + reads[-1][3] == size > INDEX_AT, (reads[-1], size)
    assert not [k for k in st.ranged if "/c/" in k], st.ranged
    # one I/O thread: the blocks of a read are checked right after it, before the next read
    first_check = st.events.index(checks[0])
    assert first_check < st.events.index(reads[1]), st.events
    assert {e[-1] for e in checks} == {e[-1] for e in reads} != {threading.current_thread().name}


def test_a_bad_inner_chunk_is_corrupt_naming_it_once_every_read_is_over(tmp_path, monkeypatch):
    root, _w = _saved(tmp_path)
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 64 * 1024)
    path = f"{root}/{D1}/model/w/c/0/0"
    with open(path, "r+b") as fh:      # a byte of inner chunk 1, in the first read
        fh.seek(16 * 1024 + 4 + 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    st = LoggedStorage(root)
    with pytest.raises(CheckpointCorrupt, match=r"model/w/c/0/0.*inner chunk 1 fails its crc32c"):
        load_step(st, D1, {"model": {"w": torch.zeros(64, 1024)}}, 0)
    st.close()
    assert len([e for e in st.events if e[0] == "read" and "/c/" in e[1]]) == 6   # the last with the index: none still running



def test_reads_start_while_the_rest_is_planned(tmp_path, monkeypatch):
    """On a local disk each read starts as soon as it is planned (``read_into`` takes the plan
    as an iterator): the first array's read is under way before the second array's blocks are
    made, instead of the disk waiting for the whole plan. (The planner waits for that read
    to start, at most 30 s: with the whole plan made first, it never would.)"""
    root = str(tmp_path / "ckpt")
    a, b = torch.arange(4096, dtype=torch.float32).reshape(64, 64), -torch.arange(4096, dtype=torch.float32)
    store = CheckpointStore(f"file://{root}", writer="thread")
    store.save(1, {"model": {"a": a, "b": b}}, async_=False)
    store.close()
    started = threading.Event()

    class Signalling(LoggedStorage):
        def _preadv(self, key, start, bufs):
            started.set()
            return super()._preadv(key, start, bufs)

        def _preadv_direct(self, key, start, bufs):
            started.set()
            return super()._preadv_direct(key, start, bufs)

    real_init, waited = loader._Block.__init__, []

    def init(blk, key, spec, *args):
        if spec.name == "model/b" and not waited:
            waited.append(started.wait(timeout=30))
        real_init(blk, key, spec, *args)
    monkeypatch.setattr(loader._Block, "__init__", init)
    st = Signalling(root)
    target = {"model": {"a": torch.zeros(64, 64), "b": torch.zeros(4096)}}
    load_step(st, D1, target, 0)
    st.close()
    assert waited == [True], "model/a's read did not start before model/b's blocks were planned"
    assert torch.equal(target["model"]["a"], a) and torch.equal(target["model"]["b"], b)

def _rewrite_index(path: str, spec: ArraySpec, change) -> None:
    """Rewrite the shard index at the end of a chunk object (``change`` edits the decoded rows),
    with a valid crc32c, as a writer of another layout would leave it."""
    n = index_nbytes(spec)
    with open(path, "r+b") as fh:
        fh.seek(-n, 2)
        raw = fh.read(n)
        index = decode_index(path, raw, spec).copy()
        change(index)
        body = index.astype("<u8").tobytes()
        fh.seek(-n, 2)
        fh.write(body + crc32c.crc32c(body).to_bytes(4, "little"))


def test_a_shard_index_other_than_the_object_size_says_is_corrupt(tmp_path):
    """The index is read with the data, at the offsets the object's size implies; an index
    that says otherwise (inner chunks in another order) is CheckpointCorrupt naming the object."""
    root, _w = _saved(tmp_path)
    spec = ArraySpec("model/w", (64, 1024), "float32", (64, 1024), 4)

    def swap(index):
        index[[0, 1]] = index[[1, 0]]
    _rewrite_index(f"{root}/{D1}/model/w/c/0/0", spec, swap)
    st = LoggedStorage(root)
    with pytest.raises(CheckpointCorrupt, match=r"model/w/c/0/0.*shard index does not match"):
        load_step(st, D1, {"model": {"w": torch.zeros(64, 1024)}}, 0)
    st.close()


@pytest.mark.unit
def test_the_index_predicted_from_the_size_is_the_one_encode_chunk_writes():
    spec = ArraySpec("a", (10, 3), "float32", (8, 3), 2)      # 4 inner chunks of 2 rows per chunk
    for valid in (8, 5, 2):                                   # a whole chunk, and edge chunks
        pieces, size, _, _ = encode_chunk(bytearray(8 * 3 * 4), spec, valid)
        idx = decode_index("a", bytes(pieces[-2]) + bytes(pieces[-1]), spec)
        assert (predicted_index(spec, size) == idx).all(), valid
    assert predicted_index(spec, 7) is None and predicted_index(spec, index_nbytes(spec) + 29) is None



def _column_split_save(root: str, values: dict[str, torch.Tensor], world: int) -> None:
    """Step 1 as ``world`` ranks would save it with every array split by columns (a
    tensor-parallel layout: one chunk per rank, ``Shard(dim=1)``), rank by rank."""
    st = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)
    how = {"mesh_shape": [world], "mesh_dim_names": ["tp"], "placements": ["Shard(dim=1)"]}
    specs = [ArraySpec(name, tuple(v.shape), "float32", (v.shape[0], v.shape[1] // world), None)
             for name, v in values.items()]
    st.write(f"{D1}/{BEGIN_MARKER}", [b"{}"])
    for rank in range(world):
        chunks = []
        for spec, v in zip(specs, values.values()):
            cols = spec.chunks[1]
            data = v[:, rank * cols:(rank + 1) * cols].contiguous().numpy().tobytes()
            chunks.append((chunk_key(spec.name, (0, rank)), spec, memoryview(data), spec.chunks[0]))
        meta = [(f"{s.name}/zarr.json", json.dumps(array_metadata(s, {"marind": how})).encode())
                for s in specs if rank == 0]
        handoff = SnapshotHandoff()
        handoff.advance(len(chunks), complete=True)
        write_rank_part(st, D1, rank, chunks, {"rank": rank}, meta, handoff=handoff)
    commit(st, D1, 1, world, specs, {s.name: how for s in specs}, {"world_size": world, "saved_at": "2026-01-01T00:00:00Z"},
           timeout_s=30, fmt=FORMAT)
    st.close()


@pytest.mark.parametrize("no_grad", [True, False])
def test_a_resharded_load_fills_parameters_that_require_grad(tmp_path, no_grad):
    """Blocks that do not land contiguously in the target (here: column chunks of a tensor-parallel
    save, loaded whole) are placed in the I/O threads, whose grad mode is their own: a target of
    nn.Parameters must still load, as it does in the caller's thread under no_grad."""
    root = str(tmp_path / "ckpt")
    values = {"model/w": torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12),
              "model/v": -torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)}
    _column_split_save(root, values, world=3)
    target = {"model": {"w": torch.nn.Parameter(torch.zeros(16, 12)), "v": torch.nn.Parameter(torch.zeros(8, 6))}}
    st = LoggedStorage(root)
    if no_grad:
        with torch.no_grad():
            stats = load_step(st, D1, target, 0)
    else:
        stats = load_step(st, D1, target, 0)
    st.close()
    assert stats["objects"] == 6          # three column chunks of each array: none lies contiguously in it
    for name, v in values.items():
        got = target["model"][name.split("/")[1]]
        assert isinstance(got, torch.nn.Parameter) and got.requires_grad and got.grad_fn is None
        assert torch.equal(got.detach(), v)


def test_an_object_store_reads_a_run_of_inner_chunks_with_one_ranged_get(url, monkeypatch):
    """``READ_GROUP_BYTES`` splits a run of back-to-back inner chunks for the local reader's
    threads only: on an object store every request is one GET of one batch (checked after
    it), so a split would only multiply the requests."""
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 64 * 1024)
    w = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    store = CheckpointStore(url, inner_chunk_bytes=16 * 1024, writer="thread")
    store.save(1, {"model": {"w": w}}, async_=False)     # 16 inner chunks of 16 KiB in one object
    store.close()
    st = open_storage(url, io_threads=2)
    requests: list[int] = []
    real = st.read_into

    def read_into(reqs, done=None):
        reqs = list(reqs)       # a local disk's are planned as they are read: an iterator
        requests.append(len(reqs))
        return real(reqs, done)
    monkeypatch.setattr(st, "read_into", read_into)
    target = {"model": {"w": torch.zeros(64, 1024)}}
    load_step(st, D1, target, 0)
    st.delete_prefix("")
    st.close()
    assert torch.equal(target["model"]["w"], w)
    # 3 + 3 + 3 + 3 + 3 + 1 inner chunks on a disk, the shard index with the last of them, and the
    # JSON values in the same batch (not a request after it)
    assert requests == ([7] if st.local else [2]), requests

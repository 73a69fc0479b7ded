"""Rank 0's commit does not grow with arrays x ranks (issue 21): counted storage calls and bytes.

Each rank's part of a save (``rank_part.write_rank_part``: its chunk objects, array
metadata, values, object list and done marker) is written for W ranks of an FSDP-like
save, where every one of A arrays has one chunk object per rank (A x W objects), on a
real local filesystem; then rank 0's ``commit`` runs on a ``LocalStorage`` subclass that
counts every storage call and the bytes it reads, writes and lists. With W in {2, 4} and
A in {50, 200}: the number of calls does not depend on A, and the bytes have no A x W
term (the four corners add up: f(4,200) - f(2,200) == f(4,50) - f(2,50), within a few
bytes of number formatting). The committed step then verifies clean, loads exactly, and
a format-1 manifest of the same objects (everything listed in the manifest) still loads.
A load of W ranks reads each of the W object lists once for the job, not once per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pytest
import torch

from ckpt_store import CheckpointStore
from ckpt_store.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from ckpt_store.format.manifest import FORMAT, PartShare, read_manifest
from ckpt_store.format.steps import BEGIN_MARKER
from ckpt_store.format.zarr_format import ArraySpec, array_metadata, chunk_key
from ckpt_store.save.commit import commit
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.rank_part import write_rank_part
from ckpt_store.storage.base import json_bytes
from ckpt_store.storage.local_disk import LocalStorage

ROWS, COLS = 16, 8       # each rank's shard of each array: 16 x 8 float32 (512 bytes, one plain chunk;
#                          16 rows: the global shapes of 2 and 4 ranks print with the same digits)


class CountingStorage(LocalStorage):
    """The real local backend; every storage call counted, with the bytes read, written, listed."""

    def __init__(self, root: str):
        super().__init__(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)
        self.calls: Counter = Counter()
        self.bytes_read = self.bytes_written = self.entries_listed = 0

    def write(self, key, pieces, crc=None):
        self.calls["write"] += 1
        self.bytes_written += sum(memoryview(p).nbytes for p in pieces)
        return super().write(key, pieces, crc)

    def write_json_atomic(self, key, obj):
        self.calls["write_json_atomic"] += 1
        self.bytes_written += len(json_bytes(obj))
        return super().write_json_atomic(key, obj)

    def make_durable(self, keys):
        self.calls["make_durable"] += 1
        return super().make_durable(keys)

    def read(self, key):
        self.calls["read"] += 1
        data = super().read(key)
        self.bytes_read += len(data)
        return data

    def list_dir(self, key=""):
        self.calls["list_dir"] += 1
        out = super().list_dir(key)
        self.entries_listed += len(out)
        return out

    def object_sizes(self, key):
        self.calls["object_sizes"] += 1
        out = super().object_sizes(key)
        self.entries_listed += len(out)
        return out

    def exists(self, key):
        self.calls["exists"] += 1
        return super().exists(key)

    def size(self, key):
        self.calls["size"] += 1
        return super().size(key)


def _value(name_index: int, rank: int) -> np.ndarray:
    return np.full((ROWS, COLS), name_index * 1000 + rank, dtype=np.float32)


def _specs(arrays: int, world: int) -> list[ArraySpec]:
    return [ArraySpec(f"model/w{i:05d}", (ROWS * world, COLS), "float32", (ROWS, COLS), None)
            for i in range(arrays)]


def _layout(world: int) -> dict:
    return {"mesh_shape": [world], "mesh_dim_names": ["dp"], "placements": ["Shard(dim=0)"]}


def _write_parts(root: str, arrays: int, world: int) -> list[ArraySpec]:
    """Every rank's part of step 1 (as each rank's writer would write it), rank by rank."""
    specs = _specs(arrays, world)
    st = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)
    st.write(f"step-0000000001/{BEGIN_MARKER}", [b"{}"])     # rank 0's, before any rank writes
    for rank in range(world):
        chunks = [(chunk_key(s.name, (rank, 0)), s, memoryview(_value(i, rank).tobytes()), ROWS)
                  for i, s in enumerate(specs)]
        meta = [(f"{s.name}/zarr.json", json.dumps(array_metadata(s, {"marind": _layout(world)}), indent=1).encode())
                for s in specs if rank == 0]        # the writer of an array's first chunk writes its metadata
        handoff = SnapshotHandoff()
        handoff.advance(len(chunks), complete=True)
        write_rank_part(st, "step-0000000001", rank, chunks, {"rank": rank}, meta, handoff=handoff)
    st.close()
    return specs


def _rank0_commit(tmp_path, arrays: int, world: int) -> tuple[CountingStorage, dict, str]:
    root = str(tmp_path / f"a{arrays}-w{world}")
    specs = _write_parts(root, arrays, world)
    st = CountingStorage(root)
    manifest = commit(st, "step-0000000001", 1, world, specs, {s.name: _layout(world) for s in specs},
                      {"world_size": world, "saved_at": "2026-01-01T00:00:00Z"}, timeout_s=30, fmt=FORMAT)
    st.close()
    return st, manifest, root


def test_rank0_commit_calls_and_bytes_do_not_grow_with_arrays_times_ranks(tmp_path):
    runs = {(a, w): _rank0_commit(tmp_path, a, w) for a in (50, 200) for w in (2, 4)}
    calls = {k: sum(st.calls.values()) for k, (st, _m, _r) in runs.items()}
    for w in (2, 4):     # no call per array: the same calls for 50 and 200 arrays
        assert runs[(50, w)][0].calls == runs[(200, w)][0].calls, (w, runs[(50, w)][0].calls)
    assert calls[(50, 4)] - calls[(50, 2)] <= 2 * 2, calls     # at most a read per rank's marker, and a listing
    for measure in ("bytes_read", "bytes_written", "entries_listed"):
        f = {k: getattr(st, measure) for k, (st, _m, _r) in runs.items()}
        interaction = (f[(200, 4)] - f[(200, 2)]) - (f[(50, 4)] - f[(50, 2)])
        # an A x W term would add at least one entry (~60 bytes) per extra (array, rank): 150 x 2 here
        assert abs(interaction) <= 16, (measure, f)
    for _st, manifest, _root in runs.values():   # the manifest lists the arrays and W object lists, not A x W objects
        assert len(manifest["parts"]) == manifest["world"]["world_size"]
        assert not any("/c/" in key for key in manifest["objects"])


@pytest.mark.parametrize("fmt", [FORMAT, 1])
def test_a_committed_step_verifies_and_loads_and_format_1_still_reads(tmp_path, fmt):
    arrays, world = 6, 4
    _st, manifest, root = _rank0_commit(tmp_path, arrays, world)
    store = CheckpointStore(f"file://{root}")
    merged = store.manifest(1)
    assert len([k for k in merged["objects"] if "/c/" in k]) == arrays * world
    if fmt == 1:     # what this step's manifest was before per-rank object lists: everything in it
        old = {k: v for k, v in merged.items() if k != "parts"}
        old["objects"] = {k: v for k, v in merged["objects"].items() if not k.startswith("parts/")}
        old["format"] = 1
        data = json.dumps(old).encode()
        with open(f"{root}/step-0000000001/manifest.json", "wb") as fh:
            fh.write(data)
        assert "parts" not in store.manifest(1)
    report = store.verify(1)
    assert report.ok, report.problems
    target = {"model": {s.name.split("/", 1)[1]: torch.zeros(ROWS * world, COLS) for s in _specs(arrays, world)}}
    store.load_arrays(target, 1)
    for i in range(arrays):
        want = torch.cat([torch.from_numpy(_value(i, r)) for r in range(world)])
        assert torch.equal(target["model"][f"w{i:05d}"], want)
    store.close()


def test_a_damaged_object_list_is_corrupt_naming_it(tmp_path):
    _st, _manifest, root = _rank0_commit(tmp_path, 3, 2)
    path = f"{root}/step-0000000001/parts/rank-00001.json"
    data = bytearray(open(path, "rb").read())
    data[10] ^= 0x01
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    store = CheckpointStore(f"file://{root}")
    with pytest.raises(CheckpointCorrupt, match="parts/rank-00001.json"):
        store.manifest(1)
    store.close()


class ThreadGather:
    """An all-gather of JSON values between W threads, each playing a rank (across processes
    ``agreement.all_gather_json`` does this over torch.distributed; multi-rank loads run it)."""

    def __init__(self, world: int):
        self.values: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def for_rank(self, rank: int):
        def gather(obj):
            self.values[rank] = json.loads(json.dumps(obj))
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out
        return gather


def _shared_reads(root: str, world: int, roots: list[str] | None = None) -> list:
    """Every rank's ``read_manifest`` of step 1 with the lists shared: (storage, manifest or error).
    ``roots``: each rank's own copy of the store (what it sees), else ``root`` for all."""
    gather = ThreadGather(world)
    stores = [CountingStorage(roots[rank] if roots else root) for rank in range(world)]

    def one(rank):
        try:
            return read_manifest(stores[rank], "step-0000000001", PartShare(rank, world, gather.for_rank(rank)))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
    with ThreadPoolExecutor(world) as pool:
        got = list(pool.map(one, range(world)))
    for st in stores:
        st.close()
    return list(zip(stores, got))


def test_a_load_reads_each_object_list_once_per_job_not_once_per_rank(tmp_path):
    world = 4
    _st, _manifest, root = _rank0_commit(tmp_path, 50, world)
    alone = CountingStorage(root)
    whole = read_manifest(alone, "step-0000000001")
    alone.close()
    assert alone.calls == {"read": 1 + world}         # without sharing: W lists per rank, W x W per job
    for rank, (st, manifest) in enumerate(_shared_reads(root, world)):
        assert st.calls == {"read": 2}, (rank, st.calls)    # manifest.json and 1/W of the lists
        assert manifest == whole
    path = f"{root}/step-0000000001/parts/rank-00002.json"
    data = bytearray(open(path, "rb").read())
    data[10] ^= 0x01
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    for rank, (st, got) in enumerate(_shared_reads(root, world)):   # read by rank 2, corrupt on every rank
        assert isinstance(got, CheckpointCorrupt) and "parts/rank-00002.json" in str(got), (rank, got)
        assert st.calls == {"read": 2}


@pytest.mark.parametrize("damage", ["deleted", "unreadable"])
def test_a_manifest_gone_or_unreadable_on_one_rank_fails_the_shared_read_alike_on_every_rank(tmp_path, damage):
    """Rank 1 sees step 1 without its manifest (deleted under it: retention, another reader's
    quarantine) or cannot read it (an OSError that says nothing about the step): the other
    ranks, which read theirs, raise an error of the same kind (``load_newest`` maps the kind to
    its outcome: not found = skip the step, anything else but corrupt = raise everywhere)."""
    world = 3
    _st, _manifest, root = _rank0_commit(tmp_path, 5, world)
    seen_by_1 = str(tmp_path / "seen-by-1")
    shutil.copytree(root, seen_by_1)
    path = f"{seen_by_1}/step-0000000001/manifest.json"
    os.remove(path)
    if damage == "unreadable":
        os.mkdir(path)                 # reading it is IsADirectoryError, on rank 1 only
    got = _shared_reads(root, world, roots=[root, seen_by_1, root])
    for rank, (_st, err) in enumerate(got):
        if damage == "deleted":
            assert type(err) is CheckpointNotFound and "step-0000000001" in str(err), (rank, err)
        elif rank == 1:
            assert isinstance(err, IsADirectoryError), err
        else:
            assert type(err) is CheckpointError, (rank, err)     # not NotFound, not Corrupt: fatal
            assert "rank 1 failed to read the manifest: IsADirectoryError" in str(err), err

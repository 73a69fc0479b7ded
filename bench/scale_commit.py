"""The checkpoint commit at many simulated ranks (``bench/scale.py``'s ``commit`` figures).

W simulated ranks each write their part of one step through ckpt_store's own code
(``rank_part.write_rank_part``: their JSON values, their object list, their done marker;
metadata only: one tiny array, its ``zarr.json`` left to rank 0), all before rank 0 begins,
so that rank 0's count holds no polls of a marker that is not there yet (how many polls a
live save makes depends on when the slowest rank ends, not on W). Then, through a
``CountingStorage``:

* ``rank0_storage_calls``, ``commit_s``: rank 0's ``commit`` (reads the W markers, writes the
  group and array metadata, lists the markers and object lists, writes the manifest);
* ``load_list_reads``, ``load_s``: ``read_manifest`` in one process (every object list: what
  ``CheckpointStore.manifest``/``verify`` read); ``load_rank0_list_reads``: rank 0's reads in
  a collective load, where each rank reads 1/W of the lists (``PartShare``);

on a local disk (``file://``) or S3 (SeaweedFS, ``marind.testing.s3_server``). Storage
calls are calls of the ``Storage`` protocol (an S3 listing of more than 1,000 keys is one
call and several requests).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_store.format.manifest import FORMAT, PartShare, read_manifest
from ckpt_store.format.steps import BEGIN_MARKER
from ckpt_store.format.zarr_format import ArraySpec
from ckpt_store.save.commit import commit
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.rank_part import write_rank_part
from ckpt_store.storage.protocol import open_storage

#: methods that make no storage request (a thread pool, a key's path)
NOT_CALLS = frozenset({"pool", "path", "close"})


class CountingStorage:
    """A ``Storage`` that counts the calls made through it, by method."""

    def __init__(self, st):
        self._st = st
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        attr = getattr(self._st, name)
        if not callable(attr) or name in NOT_CALLS:
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                self.calls[name] += 1
            return attr(*args, **kwargs)
        return counted

    def total(self) -> int:
        return sum(self.calls.values())

    def of(self, *names: str) -> int:
        return sum(self.calls[n] for n in names)


def _parts(st, d: str, world: int, threads: int = 16) -> None:
    done = SnapshotHandoff()
    done.advance(0, complete=True)
    st.write_json_atomic(f"{d}/{BEGIN_MARKER}", {"step": 1, "world": world})

    def one(rank: int) -> None:
        write_rank_part(st, d, rank, [], {"rank": rank, "rng": [rank, 1, 2, 3]}, handoff=done, timeout_s=60)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(world)))


def commit_at(url: str, world: int, storage_options: dict | None = None) -> dict:
    """Counted and timed commit and list reads of one step of ``world`` simulated ranks at ``url``."""
    st = open_storage(url, storage_options)
    try:
        d = f"step-{world:07d}"
        _parts(st, d, world)
        spec = ArraySpec("model/w", (world, 4), "float32", (1, 4), None)
        layout = {"kind": "sharded", "dim": 0, "world": world}
        counted = CountingStorage(st)
        began = time.perf_counter()
        commit(counted, d, 1, world, [spec], {spec.name: layout}, {"saved_at": time.time(), "world": world},
               timeout_s=120, fmt=FORMAT)
        out = {"ranks": world, "commit_s": round(time.perf_counter() - began, 4),
               "rank0_storage_calls": counted.total(), "rank0_calls": dict(counted.calls)}
        reader = CountingStorage(st)
        began = time.perf_counter()
        manifest = read_manifest(reader, d)
        out["load_s"] = round(time.perf_counter() - began, 4)
        out["load_list_reads"] = reader.of("read", "read_json")
        assert len(manifest["parts"]) == world
        rank0 = CountingStorage(st)
        read_manifest(rank0, d, PartShare(0, world, lambda mine: [mine] + [{"objects": {}}] * (world - 1)))
        out["load_rank0_list_reads"] = rank0.of("read", "read_json")
        return out
    finally:
        st.close()


def measure(ranks: list[int], s3: bool = True, log=print) -> dict:
    """``commit_at`` for each rank count on a local disk and (``s3``) on SeaweedFS:
    ``{str(ranks): {local figures..., "s3": {...}}}``."""
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="marind-scale-commit-") as tmp:
        server = None
        if s3:
            from marind.testing.s3_server import SeaweedS3
            server = SeaweedS3(Path(tmp) / "s3").start()
        try:
            for w in ranks:
                row = commit_at(f"file://{tmp}/local-{w}", w)
                log(f"commit at {w} ranks, local disk: {row['rank0_storage_calls']} calls, {row['commit_s']} s")
                if server is not None:
                    row["s3"] = commit_at(server.url(f"scale-{w}"), w, server.storage_options)
                    log(f"commit at {w} ranks, S3: {row['s3']['rank0_storage_calls']} calls, {row['s3']['commit_s']} s")
                out[str(w)] = row
        finally:
            if server is not None:
                server.stop()
    return out

"""One rank's background part of a save: its chunk objects, its values, its object list, its done marker.

``run_save`` is what a writer (process or thread) runs for each ``SaveJob``:
encode (crc32c) and write this rank's chunks from the snapshot memory as the
copy hands them over (``handoff.py``), its JSON values and the list of its
objects (``{step}/parts/rank-R.json``), flush them, write its done marker
(``{step}/.marind/rank-R.json``: the list's size and crc32c and the arrays
whose ``zarr.json`` it wrote, never the objects themselves); then rank 0 commits and the
other ranks wait for that commit (``commit.py``), and rank 0 applies
retention. Only storage operations, never torch collectives, and no torch
import: this runs in the writer process (or a thread) next to training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import wait
from typing import TYPE_CHECKING

import crc32c

from ckpt_store.errors import DISK_FULL, failure_kind
from ckpt_store.format.manifest import part_key
from ckpt_store.format.steps import apply_retention
from ckpt_store.format.zarr_format import ArraySpec, array_metadata, chunk_key, encode_chunk
from ckpt_store.log import get_logger
from ckpt_store.save.commit import commit, fail_part, marker_key, metadata_bytes, wait_for_commit
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.save_job import SaveJob

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)


def values_key(d: str, rank: int) -> str:
    return f"{d}/values/rank-{rank:05d}.json"


def run_save(st: Storage, job: SaveJob, arena: memoryview, on_commit, handoff: SnapshotHandoff) -> None:
    """Write this rank's part of ``job``; rank 0 commits, then applies retention.
    ``on_commit(timings)`` is called at the end; failures raise. ``handoff``: how far the
    caller's copy into ``arena`` got."""
    t0 = time.perf_counter()
    d, rank = job.dir, job.rank
    try:
        specs = {name: ArraySpec.from_json(name, meta) for name, meta in job.arrays.items()}
        chunks = [(s.key, specs[s.array], arena[s.offset:s.offset + s.nbytes], s.valid_rows)
                  for s in job.slots]
        # the writer of an array's first chunk writes its zarr.json too (rank 0 fills any gap)
        firsts = {chunk_key(n, (0,) * len(spec.shape)): spec for n, spec in specs.items()}
        meta = [(f"{spec.name}/zarr.json",
                 metadata_bytes(array_metadata(spec, {"marind": job.arrays[spec.name]["layout"]})))
                for spec in (firsts.get(s.key) for s in job.slots) if spec is not None]
        mode = write_rank_part(st, d, rank, chunks, job.values, meta, nice=job.background_nice,
                               handoff=handoff, timeout_s=job.commit_timeout_s, background=job.background)
    except BaseException as exc:
        if failure_kind(str(exc)) == DISK_FULL:   # make room for the marker that tells the others
            _drop_own_objects(st, job)
        # the others stop waiting for a part (rank 0: a commit) that will not come; rank 0
        # names the failing rank in its error (``_collect``), the others in theirs
        fail_part(st, job, str(exc))
        raise
    del chunks
    timings = {"write_s": time.perf_counter() - t0, **mode}

    def stop() -> str | None:      # the ranks agreed that this save failed (``CheckpointStore.settle``)
        return handoff.error
    if rank == 0:
        commit(st, d, job.step, job.world, list(specs.values()), job.layouts(), job.saved_layout,
               timeout_s=job.commit_timeout_s, fmt=job.fmt, fence=job.fence, stop=stop)
    else:
        wait_for_commit(st, d, timeout_s=job.commit_timeout_s, background=job.background, stop=stop)
    timings["commit_s"] = time.perf_counter() - t0
    log.info("ckpt_committed", step=job.step, rank=rank, seconds=round(timings["commit_s"], 3))
    trash: list[str] = []
    if rank == 0:
        try:   # the step just committed stays, even below the newest (a run resumed from an older step)
            apply_retention(st, job.keep_last, job.keep_every, in_flight=set(), trash=trash,
                            keep={job.step})
        except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
            log.warning("ckpt_retention_failed", error=str(exc))
    on_commit(timings)
    for key in trash:   # steps retention uncommitted (renamed out of sight on a local disk): delete them now
        try:
            st.delete_prefix(key)
        except Exception as exc:  # noqa: BLE001
            log.warning("ckpt_trash_delete_failed", key=key, error=str(exc))


def _drop_own_objects(st: Storage, job: SaveJob) -> None:
    """A part that failed on a full disk: delete what this rank wrote of the step (best effort),
    so that its error marker (or rank 0's abort marker) fits and the others learn at once."""
    keys = [f"{job.dir}/{s.key}" for s in job.slots] + [values_key(job.dir, job.rank), f"{job.dir}/{part_key(job.rank)}"]
    for key in keys:
        try:
            st.delete_prefix(key)
        except Exception:  # noqa: BLE001 - best effort: the agreement at the next save tells the others anyway
            pass


def write_rank_part(st: Storage, d: str, rank: int, chunks: list, values: dict, meta: Sequence[tuple[str, bytes]] = (),
                    nice: int = 0, *, handoff: SnapshotHandoff, timeout_s: float = 600.0,
                    background: bool = False) -> dict[str, float]:
    """Encode + write this rank's chunks ``(key, spec, buffer, valid_rows)``, metadata objects
    ``(key, bytes)`` and JSON values, then its object list (``parts/rank-R.json``), then its done
    marker, which names the list and the arrays whose ``zarr.json`` this rank wrote, so that rank
    0 reads O(1 + those arrays) from it (on failure the caller, ``run_save``, writes the error
    marker: ``fail_part``). ``background``: an async save (the storage picks its write path
    by it: ``Storage.begin_part``). Returns the write path's timings (``{"direct_io": 0/1}``).
    ``nice``: run the encoding and writes on I/O threads that much nicer (async saves).
    ``handoff``: chunk ``i`` is written once the caller copied it; the done marker only
    once the whole copy is complete (``handoff.py``)."""
    objects: dict[str, dict] = {}

    def one(index, item):
        key, spec, buf, valid_rows = item
        handoff.wait_slot(index, timeout_s)
        pieces, size, crc, digest = encode_chunk(buf, spec, valid_rows)
        st.write(f"{d}/{key}", pieces, crc=crc)
        return key, {"size": size, "crc32c": crc, "chunks_crc32c": digest}

    def small(item):
        key, data = item
        crc = crc32c.crc32c(data)
        st.write(f"{d}/{key}", [data], crc=crc)
        return key, {"size": len(data), "crc32c": crc}

    mode = st.begin_part(background)
    started = time.perf_counter()
    pool = st.pool(nice)
    futures = [pool.submit(one, i, c) for i, c in enumerate(chunks)] + [pool.submit(small, m) for m in meta]
    wait(futures)  # all writes are over before this returns or raises: the snapshot is free
    for fut in futures:
        key, objects[key] = fut.result()
    mode |= st.end_part(sum(o["size"] for o in objects.values()), time.perf_counter() - started, background)
    handoff.wait_complete(timeout_s)
    data = json.dumps(values, sort_keys=True).encode()
    vkey = values_key(d, rank)
    st.write(vkey, [data])
    objects[vkey[len(d) + 1:]] = {"size": len(data), "crc32c": crc32c.crc32c(data)}
    listing = json.dumps({"rank": rank, "objects": objects}, sort_keys=True).encode()
    pkey = part_key(rank)
    st.write(f"{d}/{pkey}", [listing])
    st.make_durable([f"{d}/{key}" for key in [*objects, pkey]])   # before the marker that names them
    part = {"key": pkey, "size": len(listing), "crc32c": crc32c.crc32c(listing), "objects": len(objects)}
    wrote_meta = sorted(key[:-len("/zarr.json")] for key, _ in meta)
    st.write_json_atomic(marker_key(d, "rank", rank), {"rank": rank, "part": part, "meta": wrote_meta})
    return mode

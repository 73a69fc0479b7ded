"""The write side of the commit protocol: rank parts, done markers, metadata, manifest.

Only storage operations, never torch collectives, and no torch import: this
runs in the writer process (or a thread) next to training. ``run_save``
takes a JSON job (built by ``CheckpointStore.save``) and the snapshot
memory. Rank 0 learns that the others are done from their marker objects
(``{step}/.marind/rank-R.json``), written after all their chunk objects; it
writes ``manifest.json`` last, then applies retention.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import wait

import crc32c

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.handoff import SnapshotHandoff
from ckpt_store.steps import apply_retention
from ckpt_store.zarr_format import ArraySpec, array_metadata, chunk_key, encode_chunk, group_metadata
from marind.core.log import get_logger

log = get_logger(__name__)
MARKERS = ".marind"
POLL_S = 0.05             # polling object stores (each poll is a request)
POLL_BACKGROUND_S = 0.2   # the other ranks of an async save, polling an object store for the commit
POLL_LOCAL_S = 0.01       # polling a local disk (each poll is a stat)
ABORT_EVERY = 5           # the other ranks look for rank 0's abort marker every this many polls


def _marker(d: str, kind: str, rank: int) -> str:
    return f"{d}/{MARKERS}/{kind}-{rank:05d}.json"


def values_key(d: str, rank: int) -> str:
    return f"{d}/values/rank-{rank:05d}.json"


def run_save(st, job: dict, arena: memoryview, on_commit, handoff: SnapshotHandoff) -> None:
    """Write this rank's part of ``job``; rank 0 commits, then applies retention.
    ``on_commit(timings)`` is called at the end; failures raise. ``handoff``: how far the
    caller's copy into ``arena`` got."""
    t0 = time.perf_counter()
    d, rank = job["dir"], job["rank"]
    try:
        specs = {name: ArraySpec.from_json(name, meta) for name, meta in job["arrays"].items()}
        chunks = [(s["key"], specs[s["array"]], arena[s["offset"]:s["offset"] + s["nbytes"]], s["valid_rows"])
                  for s in job["slots"]]
        # the writer of an array's first chunk writes its zarr.json too (rank 0 fills any gap)
        firsts = {chunk_key(n, (0,) * len(spec.shape)): spec for n, spec in specs.items()}
        meta = [(f"{spec.name}/zarr.json",
                 _json_bytes(array_metadata(spec, {"marind": job["arrays"][spec.name]["layout"]})))
                for spec in (firsts.get(s["key"]) for s in job["slots"]) if spec is not None]
        write_rank_part(st, d, rank, chunks, job["values"], meta, nice=job.get("background_nice", 0),
                        handoff=handoff, timeout_s=job["commit_timeout_s"])
    except BaseException as exc:
        # the others stop waiting for a part (rank 0: a commit) that will not come; rank 0
        # names the failing rank in its error (``_collect``), the others in theirs
        fail_part(st, job, str(exc))
        raise
    del chunks
    timings = {"write_s": time.perf_counter() - t0}
    if rank == 0:
        commit(st, d, job["step"], job["world"], list(specs.values()),
               {n: m["layout"] for n, m in job["arrays"].items()}, job["saved_layout"],
               timeout_s=job["commit_timeout_s"], fmt=job["fmt"], fence=job.get("fence"))
    else:
        wait_for_commit(st, d, timeout_s=job["commit_timeout_s"], background=job.get("background", False))
    timings["commit_s"] = time.perf_counter() - t0
    log.info("ckpt_committed", step=job["step"], rank=rank, seconds=round(timings["commit_s"], 3))
    trash: list[str] = []
    if rank == 0:
        try:   # the step just committed stays, even below the newest (a run resumed from an older step)
            apply_retention(st, job.get("keep_last"), job.get("keep_every"), in_flight=set(), trash=trash,
                            keep={job["step"]})
        except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
            log.warning("ckpt_retention_failed", error=str(exc))
    on_commit(timings)
    for key in trash:   # steps retention uncommitted (renamed out of sight on a local disk): delete them now
        try:
            st.delete_prefix(key)
        except Exception as exc:  # noqa: BLE001
            log.warning("ckpt_trash_delete_failed", key=key, error=str(exc))


def fail_part(st, job: dict, error: str) -> None:
    """This rank's part of ``job`` failed before ``run_save`` could say so: tell the others
    now (rank 0: the abort marker; any other rank: its error marker), not at their timeout."""
    if job["rank"] == 0:
        write_abort_marker(st, job["dir"], error)
    else:
        write_error_marker(st, job["dir"], job["rank"], error)


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode()


def write_rank_part(st, d: str, rank: int, chunks: list, values: dict, meta: list = (),
                    nice: int = 0, *, handoff: SnapshotHandoff, timeout_s: float = 600.0) -> dict:
    """Encode + write this rank's chunks ``(key, spec, buffer, valid_rows)``, metadata objects
    ``(key, bytes)`` and JSON values, then its done marker (on failure the caller, ``run_save``,
    writes the error marker: ``fail_part``).
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

    pool = st.pool(nice)
    futures = [pool.submit(one, i, c) for i, c in enumerate(chunks)] + [pool.submit(small, m) for m in meta]
    wait(futures)  # all writes are over before this returns or raises: the snapshot is free
    for fut in futures:
        key, objects[key] = fut.result()
    handoff.wait_complete(timeout_s)
    data = json.dumps(values, sort_keys=True).encode()
    vkey = values_key(d, rank)
    st.write(vkey, [data])
    objects[vkey[len(d) + 1:]] = {"size": len(data), "crc32c": crc32c.crc32c(data)}
    st.make_durable([f"{d}/{key}" for key in objects])   # before the marker that lists them
    st.write_json_atomic(_marker(d, "rank", rank), {"rank": rank, "objects": objects})
    return objects


def write_error_marker(st, d: str, rank: int, error: str) -> None:
    """Tell rank 0 this rank's part failed (so the commit aborts now, not at its timeout)."""
    try:
        st.write_json_atomic(_marker(d, "error", rank), {"rank": rank, "error": error})
    except Exception:  # noqa: BLE001 - storage may be down; rank 0 then times out
        pass


def write_abort_marker(st, d: str, error: str) -> None:
    """Rank 0: tell the other ranks this step will not commit."""
    try:
        st.write_json_atomic(f"{d}/{MARKERS}/abort.json", {"error": error})
    except Exception:  # noqa: BLE001
        pass


def check_fence(fence: list | None, now: float | None = None) -> None:
    """Rank 0, right before the manifest: may this world still commit?

    ``fence`` is ``[path, margin_s]`` (``CheckpointStore(fence_file=...)``) or None. The file's
    ``valid_until`` (Unix seconds: marind's node lease, last renewal + TTL) must leave
    ``margin_s`` (at most a quarter of the file's ``ttl``, when it gives one); past it, other
    nodes may have formed a new world without this one.

    Raises:
        CheckpointSaveFailed: the fence has passed (the save aborts uncommitted).
    """
    if not fence:
        return
    path, margin = fence
    try:
        with open(path) as fh:
            doc = json.load(fh)
        valid_until = float(doc["valid_until"])
        if doc.get("ttl"):
            margin = min(margin, float(doc["ttl"]) / 4)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return                      # no fence file: nothing to fence against
    now = time.time() if now is None else now
    if valid_until - now < margin:
        raise CheckpointSaveFailed(
            f"not committing: this world may have been replaced ({path}: valid until {valid_until:.1f}, "
            f"now {now:.1f}, margin {margin:g}s)")


def commit(st, d: str, step: int, world: int, specs: list[ArraySpec], layouts: dict,
           saved_layout: dict, timeout_s: float, fmt: int, fence: list | None = None) -> dict:
    """Rank 0: wait for every rank's marker, write the group (and any missing array) metadata,
    then manifest.json (only while ``fence`` allows, ``check_fence``)."""
    try:
        objects = _collect(st, d, world, timeout_s)
        meta: dict[str, dict] = {}
        groups = {""}
        for spec in specs:
            if f"{spec.name}/zarr.json" not in objects:   # no rank wrote it (an array without chunks)
                meta[f"{spec.name}/zarr.json"] = array_metadata(spec, {"marind": layouts[spec.name]})
            parts = spec.name.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        root_attrs = {"marind": {"format": fmt, "step": step, "saved_layout": saved_layout,
                                 "created_at": saved_layout.get("saved_at")}}
        for g in groups:
            meta[f"{g}/zarr.json" if g else "zarr.json"] = group_metadata(root_attrs if not g else None)
        items = []
        for key, obj in meta.items():
            data = _json_bytes(obj)
            items.append((f"{d}/{key}", [data]))
            objects[key] = {"size": len(data), "crc32c": crc32c.crc32c(data)}
        st.write_many(items)
        st.make_durable([key for key, _ in items])
        _check_present(st, d, objects)
        manifest = {"format": fmt, "step": step, "world": saved_layout, "created_at": saved_layout["saved_at"],
                    "arrays": {s.name: {**s.to_json(), "layout": layouts[s.name]} for s in specs},
                    "objects": objects}
        check_fence(fence)
        st.write_json_atomic(f"{d}/manifest.json", manifest)
        return manifest
    except BaseException as exc:
        write_abort_marker(st, d, str(exc))
        raise


def _check_present(st, d: str, objects: dict) -> None:
    """Rank 0, right before the manifest: every object the ranks listed is there, whole.

    One listing of the step (a LIST per 1000 objects on S3). It catches what no
    rank saw fail: a step directory deleted or renamed under a save in flight
    (another store's retention on the same URL) must fail the save, never
    commit a checkpoint with holes.
    """
    for attempt in range(3):    # a listing that fails (a storage blip) is tried again
        try:
            present = st.object_sizes(d)
            break
        except Exception:
            if attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))
    bad = sorted(k for k, o in objects.items() if present.get(k) != o["size"])
    if bad:
        raise CheckpointSaveFailed(
            f"{len(bad)} objects of {d} are missing or cut short right before its commit (first {bad[0]!r}); "
            "was the step deleted under the save, e.g. by another job saving to the same URL?")


def _collect(st, d: str, world: int, timeout_s: float) -> dict:
    """Wait for every rank's done marker; one listing of the marker dir per poll. A storage
    error while polling is retried until the deadline (a blip must not fail the save)."""
    objects: dict = {}
    waiting = set(range(world))
    markers = f"{d}/{MARKERS}"

    def done(_polls: int) -> bool:
        present = set(st.list_dir(markers))
        for r in sorted(waiting):
            error = _marker(d, "error", r)
            if error.rsplit("/", 1)[1] in present:
                err = st.read_json(error).get("error")
                raise CheckpointSaveFailed(f"rank {r} failed to write its part: {err}")
            marker = _marker(d, "rank", r)
            if marker.rsplit("/", 1)[1] in present:
                objects.update(st.read_json(marker)["objects"])
                waiting.discard(r)
        return not waiting

    _poll_until(done, timeout_s, _poll(st),
                lambda: f"ranks {sorted(waiting)} did not finish their part within {timeout_s}s",
                "crashed or storage unreachable")
    return objects


def _poll_until(done: Callable[[int], bool], timeout_s: float, interval: float,
                timed_out: Callable[[], str], cause: str) -> None:
    """Call ``done(polls so far)`` every ``interval`` seconds until it returns True. It raises
    CheckpointSaveFailed to stop at once; any other error (a storage blip) is retried until
    ``timeout_s``, and the timeout's error, ``timed_out()``, then names the last one (or,
    without one, the likely ``cause``)."""
    deadline = time.monotonic() + timeout_s
    polls, last_error = 0, None
    while True:
        try:
            if done(polls):
                return
        except CheckpointSaveFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - retried; reported if it outlasts the deadline
            last_error = exc
        if time.monotonic() > deadline:
            why = f"; last storage error: {last_error}" if last_error else f" ({cause})"
            raise CheckpointSaveFailed(f"{timed_out()}{why}")
        polls += 1
        time.sleep(interval)


def _poll(st, background: bool = False) -> float:
    if getattr(st, "local", False):
        return POLL_LOCAL_S
    return POLL_BACKGROUND_S if background else POLL_S


def wait_for_commit(st, d: str, timeout_s: float, background: bool = False) -> None:
    """The other ranks: wait for rank 0's manifest (or its abort marker, looked at every
    ``ABORT_EVERY`` polls). ``background``: an async save, where nobody waits on the
    answer's latency, so an object store is asked less often. A storage error while
    polling is retried until the deadline."""
    def done(polls: int) -> bool:
        if st.exists(f"{d}/manifest.json"):
            return True
        if polls % ABORT_EVERY == 0 and st.exists(f"{d}/{MARKERS}/abort.json"):
            err = st.read_json(f"{d}/{MARKERS}/abort.json").get("error")
            raise CheckpointSaveFailed(f"rank 0 aborted the commit: {err}")
        return False

    _poll_until(done, timeout_s, _poll(st, background), lambda: f"no commit within {timeout_s}s",
                "rank 0 crashed or storage down")

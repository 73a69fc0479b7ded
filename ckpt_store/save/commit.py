"""The commit protocol's markers and its commit: rank 0 commits, the other ranks wait for it.

Each rank's part ends with its done marker (``{step}/.marind/rank-R.json``,
naming its object list ``parts/rank-R.json`` with that file's size and crc32c,
and the arrays whose ``zarr.json`` it wrote), or its error marker
(``error-R.json``) if it failed; rank 0 polls for them (``commit``), writes
the Zarr group metadata (and that of any array no rank wrote), checks that
every marker and object list is still there at its size, and writes
``manifest.json`` last: the commit. Nothing rank 0 does here grows with
arrays x ranks: it reads W small markers (those each poll lists, together in
the storage's I/O threads: ``io_threads`` requests in flight, not W round trips
in a row), lists two directories of W entries, and writes a manifest of the
arrays and the W lists. If it cannot, it writes
the abort marker (``abort.json``). The other ranks poll for the manifest or
the abort marker (``wait_for_commit``). A storage error while polling is
retried until the timeout. Storage operations only: no torch, no collectives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.format.steps import BEGIN_MARKER
from ckpt_store.format.zarr_format import ArraySpec, array_metadata, group_metadata
from ckpt_store.save.fence import check_fence
from ckpt_store.save.save_job import SaveJob
from ckpt_store.storage.base import run_all

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage

MARKERS = ".marind"
POLL_S = 0.05             # polling object stores (each poll is a request)
POLL_BACKGROUND_S = 0.2   # the other ranks of an async save, polling an object store for the commit
POLL_LOCAL_S = 0.01       # polling a local disk (each poll is a stat)
ABORT_EVERY = 5           # the other ranks look for rank 0's abort marker every this many polls
#: why to stop waiting (the ranks agreed the save failed: ``agreement.agree_settled``), or None
Stop = Callable[[], str | None] | None


def marker_key(d: str, kind: str, rank: int) -> str:
    """The key of rank ``rank``'s ``kind`` ("rank": done, "error") marker in step directory ``d``."""
    return f"{d}/{MARKERS}/{kind}-{rank:05d}.json"


def fail_part(st: Storage, job: SaveJob, error: str) -> None:
    """This rank's part of ``job`` failed before ``run_save`` could say so: tell the others
    now (rank 0: the abort marker; any other rank: its error marker), not at their timeout."""
    if job.rank == 0:
        write_abort_marker(st, job.dir, error)
    else:
        write_error_marker(st, job.dir, job.rank, error)


def metadata_bytes(obj) -> bytes:
    """How a Zarr metadata object (``zarr.json``) is encoded."""
    return json.dumps(obj, indent=1).encode()


def write_error_marker(st: Storage, d: str, rank: int, error: str) -> None:
    """Tell rank 0 this rank's part failed (so the commit aborts now, not at its timeout)."""
    try:
        st.write_json_atomic(marker_key(d, "error", rank), {"rank": rank, "error": error})
    except Exception:  # noqa: BLE001 - storage may be down; rank 0 then times out
        pass


def write_abort_marker(st: Storage, d: str, error: str) -> None:
    """Rank 0: tell the other ranks this step will not commit."""
    try:
        st.write_json_atomic(f"{d}/{MARKERS}/abort.json", {"error": error})
    except Exception:  # noqa: BLE001
        pass


def commit(st: Storage, d: str, step: int, world: int, specs: list[ArraySpec], layouts: dict,
           saved_layout: dict, timeout_s: float, fmt: int, fence: tuple[str, float] | None = None,
           stop: Stop = None) -> dict:
    """Rank 0: wait for every rank's marker, write the group (and any missing array) metadata,
    then manifest.json (only while ``fence`` allows: ``fence.check_fence``). ``stop``: polled
    while waiting; the text it returns (the ranks agreed the save failed) fails the save."""
    try:
        part_lists, wrote_meta = _collect(st, d, world, timeout_s, stop)
        objects: dict[str, dict] = {}
        meta: dict[str, dict] = {}
        groups = {""}
        for spec in specs:
            if spec.name not in wrote_meta:   # no rank wrote it (an array without chunks)
                meta[f"{spec.name}/zarr.json"] = array_metadata(spec, {"marind": layouts[spec.name]})
            parts = spec.name.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        root_attrs = {"marind": {"format": fmt, "step": step, "saved_layout": saved_layout,
                                 "created_at": saved_layout.get("saved_at")}}
        for g in groups:
            meta[f"{g}/zarr.json" if g else "zarr.json"] = group_metadata(root_attrs if not g else None)
        items = []
        for key, obj in meta.items():
            data = metadata_bytes(obj)
            items.append((f"{d}/{key}", [data]))
            objects[key] = {"size": len(data), "crc32c": crc32c.crc32c(data)}
        st.write_many(items)
        st.make_durable([key for key, _ in items])
        _check_present(st, d, world, part_lists)
        manifest = {"format": fmt, "step": step, "world": saved_layout, "created_at": saved_layout["saved_at"],
                    "arrays": {s.name: {**s.to_json(), "layout": layouts[s.name]} for s in specs},
                    "objects": objects, "parts": part_lists}
        allowed = check_fence(fence)
        if allowed is not None:
            manifest["fence"] = allowed          # what the commit was allowed on (design.md §4)
        st.write_json_atomic(f"{d}/manifest.json", manifest)
        return manifest
    except BaseException as exc:
        write_abort_marker(st, d, str(exc))
        raise


def _check_present(st: Storage, d: str, world: int, parts: list[dict]) -> None:
    """Rank 0, right before the manifest: the step's begin marker (written before any rank
    wrote anything: ``steps.prepare_step_dir``), every done marker and every object list are
    still there, the lists at their sizes.

    Two listings of W entries each (``.marind/`` and ``parts/``). They catch what no
    rank saw fail: a step directory deleted or renamed under a save in flight (another
    store's retention on the same URL) must fail the save, never commit a checkpoint with
    holes, even where the writes that came after the delete made the directory anew: a
    delete (a local recursive removal, an object store's listed prefix delete) takes the
    begin marker, older than every object, with it.
    """
    for attempt in range(3):    # a listing that fails (a storage blip) is tried again
        try:
            markers = set(st.list_dir(f"{d}/{MARKERS}"))
            lists = st.object_sizes(f"{d}/parts")
            break
        except Exception:
            if attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))
    bad = [f"{d}/{BEGIN_MARKER}"] if BEGIN_MARKER.rsplit("/", 1)[1] not in markers else []
    bad += [marker_key(d, "rank", r) for r in range(world)
            if marker_key(d, "rank", r).rsplit("/", 1)[1] not in markers]
    bad += [f"{d}/{p['key']}" for p in parts if lists.get(p["key"][len("parts/"):]) != p["size"]]
    if bad:
        raise CheckpointSaveFailed(
            f"{len(bad)} objects of {d} are missing or cut short right before its commit (first {bad[0]!r}); "
            "was the step deleted under the save, e.g. by another job saving to the same URL?")


def _collect(st: Storage, d: str, world: int, timeout_s: float, stop: Stop = None) -> tuple[list[dict], set[str]]:
    """Wait for every rank's done marker; one listing of the marker dir per poll, then the
    markers it shows read together in the storage's I/O threads (``_read_markers``). A
    storage error while polling is retried until the deadline (a blip must not fail the save).
    Returns each rank's object list entry (by rank) and the arrays whose metadata they wrote."""
    parts: dict[int, dict] = {}
    wrote_meta: set[str] = set()
    waiting = set(range(world))
    markers = f"{d}/{MARKERS}"

    def done(_polls: int) -> bool:
        present = set(st.list_dir(markers))
        for r in sorted(waiting):
            error = marker_key(d, "error", r)
            if error.rsplit("/", 1)[1] in present:
                err = st.read_json(error).get("error")
                raise CheckpointSaveFailed(f"rank {r} failed to write its part: {err}")
        ready = [r for r in sorted(waiting) if marker_key(d, "rank", r).rsplit("/", 1)[1] in present]
        got, failed = _read_markers(st, d, ready)
        for r, (part, meta) in got.items():
            parts[r] = part
            wrote_meta.update(meta)
            waiting.discard(r)
        if failed is not None:
            raise failed        # a blip: its marker is read again at the next poll, the others are kept
        return not waiting

    _poll_until(done, timeout_s, _poll(st),
                lambda: f"ranks {sorted(waiting)} did not finish their part within {timeout_s}s",
                "crashed or storage unreachable", stop)
    return [parts[r] for r in range(world)], wrote_meta


def _read_markers(st: Storage, d: str, ranks: list[int]) -> tuple[dict[int, tuple[dict, list[str]]], Exception | None]:
    """The done markers of ``ranks``, one ``read_json`` each, all at once in the storage's
    I/O threads (``io_threads`` requests in flight, not W round trips one after another).
    Returns ``{rank: (its object list entry, the arrays whose metadata it wrote)}`` for the
    markers read, and the first failure in rank order (a read that failed, a marker that
    lacks a field), or None; every read is over when this returns."""
    def one(_i: int, rank: int) -> tuple[dict, list[str]] | Exception:
        try:
            got = st.read_json(marker_key(d, "rank", rank))
            return got["part"], got["meta"]
        except Exception as exc:  # noqa: BLE001 - the caller raises it once the others are kept
            return exc

    got: dict[int, tuple[dict, list[str]]] = {}
    failed: Exception | None = None
    for rank, result in zip(ranks, run_all(st.pool(), one, ranks)):
        if isinstance(result, Exception):
            failed = failed or result
        else:
            got[rank] = result
    return got, failed


def _poll_until(done: Callable[[int], bool], timeout_s: float, interval: float,
                timed_out: Callable[[], str], cause: str, stop: Stop = None) -> None:
    """Call ``done(polls so far)`` every ``interval`` seconds until it returns True. It raises
    CheckpointSaveFailed to stop at once; any other error (a storage blip) is retried until
    ``timeout_s``, and the timeout's error, ``timed_out()``, then names the last one (or,
    without one, the likely ``cause``). ``stop()`` returning text also ends it (raised)."""
    deadline = time.monotonic() + timeout_s
    polls, last_error = 0, None
    while True:
        reason = stop() if stop is not None else None
        if reason:
            raise CheckpointSaveFailed(reason)
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


def _poll(st: Storage, background: bool = False) -> float:
    if st.local:
        return POLL_LOCAL_S
    return POLL_BACKGROUND_S if background else POLL_S


def wait_for_commit(st: Storage, d: str, timeout_s: float, background: bool = False, stop: Stop = None) -> None:
    """The other ranks: wait for rank 0's manifest (or its abort marker, looked at every
    ``ABORT_EVERY`` polls). ``background``: an async save, where nobody waits on the
    answer's latency, so an object store is asked less often. A storage error while
    polling is retried until the deadline; ``stop`` as for ``commit``."""
    def done(polls: int) -> bool:
        if st.exists(f"{d}/manifest.json"):
            return True
        if polls % ABORT_EVERY == 0 and st.exists(f"{d}/{MARKERS}/abort.json"):
            err = st.read_json(f"{d}/{MARKERS}/abort.json").get("error")
            raise CheckpointSaveFailed(f"rank 0 aborted the commit: {err}")
        return False

    _poll_until(done, timeout_s, _poll(st, background), lambda: f"no commit within {timeout_s}s",
                "rank 0 crashed or storage down", stop)

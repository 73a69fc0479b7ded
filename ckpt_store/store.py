"""CheckpointStore: the public API (DESIGN §4).

Save protocol, per step (the background part uses no torch collectives):

0. in the caller's thread: refuse an already committed step; rank 0 removes leftovers of
   an earlier failed attempt at this step, then one barrier on the default group;
1. every rank snapshots the chunks it owns into reused host memory shared with its
   writer process (the caller waits only for this; ``snapshot.py``);
2. in the background (the writer process, ``executors.py``) each rank encodes and
   writes its chunk objects and its JSON values, then a done marker
   ``.marind/rank-R.json`` listing its objects (size, crc32c) — or
   ``.marind/error-R.json`` if it failed;
3. rank 0 polls for every rank's marker, writes the Zarr metadata and finally
   ``manifest.json`` (the commit), then applies retention;
4. the other ranks' saves complete when the manifest (or rank 0's abort marker) appears.

A step without ``manifest.json`` does not exist for readers.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import operator
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ckpt_store import snapshot
from ckpt_store.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointFormatUnsupported,
    CheckpointNotFound,
    CheckpointSaveFailed,
)
from ckpt_store.executors import ProcessWriter, ThreadWriter
from ckpt_store.gather import SMALL_ARRAY_BYTES, gather_small
from ckpt_store.loader import FORMAT, load_step, read_manifest
from ckpt_store.plan import flatten, mesh_ranks, plan_array
from ckpt_store.steps import MAX_STEP, all_step_dirs, apply_retention, committed_steps, parse_step_dir, step_dir
from ckpt_store.storage import Storage
from ckpt_store.writer import fail_part
from marind.core.log import get_logger

log = get_logger(__name__)
#: niceness of an async save's encode/write threads (measured in bench/ckpt_bench.py)
BACKGROUND_NICE = 10


@dataclass
class VerifyReport:
    step: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    objects: int = 0
    bytes: int = 0


class PendingSave:
    """Handle of a save; ``wait()`` returns once committed, raises if it failed."""

    def __init__(self, step: int):
        self.step = step
        self._done = threading.Event()
        self._copied = threading.Event()   # the snapshot is taken: the state may change again
        self._copied.set()
        self._error: BaseException | None = None
        self.observed = False
        self.timings: dict[str, float] = {}
        self.finished_at: float | None = None   # time.perf_counter() when it committed or failed

    def _finish(self, error: BaseException | None, timings: dict | None = None) -> None:
        """The writer is done with this save (``_copied`` is the copy's own: only the thread
        that copies sets it, so nothing reuses the arena while that thread still writes it)."""
        if self._done.is_set():
            return
        self.timings.update(timings or {})
        self.finished_at = time.perf_counter()
        self._error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} not committed within {timeout}s")
        self.observed = True
        if self._error is not None:
            raise CheckpointSaveFailed(f"checkpoint step {self.step} did not commit: "
                                       f"{self._error}") from self._error


class CheckpointStore:
    def __init__(self, url: str, storage_options: dict | None = None, *, keep_last: int | None = None,
                 keep_every: int | None = None, commit_timeout_s: float = 600.0,
                 io_threads: int = 4, inner_chunk_bytes: int = 1 << 20,
                 io_rate_limit: float | None = None, writer: str = "auto", writer_nice: int = 0,
                 background_nice: int = BACKGROUND_NICE, direct_io: bool = True,
                 gather_small_bytes: int = SMALL_ARRAY_BYTES, fence_file: str | None = None,
                 fence_margin_s: float = 2.0):
        """``io_rate_limit``: cap background writes at this many bytes/s (None: no cap).
        ``writer``: where uploads run: "process" (a writer process per store, the default
        for file:// and s3://), "thread" (in this process; memory:// needs it), or "auto".
        ``writer_nice``: niceness added to the writer process (yields CPU to training).
        ``background_nice``: niceness added, during async saves only, to the threads that
        encode and write (training keeps the CPU; a sync save, which the caller waits
        for, runs at full priority).
        ``direct_io``: local disks: write chunk objects with O_DIRECT (no page cache; falls back
        by itself where the filesystem refuses it).
        ``gather_small_bytes``: sharded arrays of at most this many bytes are gathered and
        written whole by one rank (one object instead of one per shard; 0: never).
        ``fence_file``: a local JSON file ``{"valid_until": unix_seconds}`` (marind's run
        ``lease.json``): rank 0 writes the manifest only while it leaves ``fence_margin_s``
        seconds, else the save fails uncommitted: a world that may have been replaced never
        commits. A missing or malformed file does not fence."""
        self.url = url
        keep_last = _count("keep_last", keep_last, minimum=0)
        keep_every = _count("keep_every", keep_every, minimum=1)
        if not commit_timeout_s or commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s={commit_timeout_s!r}: use a number of seconds > 0")
        self.storage = Storage(url, storage_options, io_threads=io_threads, rate_limit=io_rate_limit,
                               direct_io=direct_io)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.commit_timeout_s = commit_timeout_s
        self.fence = [fence_file, float(fence_margin_s)] if fence_file else None
        self.background_nice = background_nice
        self.inner_chunk_bytes = inner_chunk_bytes
        self.gather_small_bytes = gather_small_bytes
        self._writer_kind = _writer_kind(writer, self.storage, storage_options)
        self._writer_config = {"url": self.storage.url, "storage_options": storage_options,
                               "io_threads": io_threads, "rate_limit": io_rate_limit, "nice": writer_nice,
                               "direct_io": direct_io}
        self._arena: snapshot.HostArena | None = None
        self._writer = None
        self._pending: PendingSave | None = None
        self._protected = False
        self.last_load_stats: dict = {}

    def protect(self, optimizer) -> None:
        """Let async saves copy the state while training goes on, until ``optimizer.step()``.

        An async ``save()`` then returns once the work that needs collectives
        is done; the snapshot copy runs on a thread (torch copies release the
        GIL; CUDA sources copy on a stream of their own) beside the next
        forward and backward, which read the state but do not change it. The
        optimizer's next ``step()`` first waits for the copy (that wait is
        counted in ``timings["step_wait_s"]``). Anything else that changes the
        state in place before then is caught (tensor version counters) and fails
        that save instead of committing a torn checkpoint.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(f"protect() needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        optimizer.register_step_pre_hook(self._before_step)
        self._protected = True

    def _before_step(self, *_args) -> None:
        pending = self._pending
        if pending is not None and not pending._copied.is_set():
            t0 = time.perf_counter()
            pending._copied.wait()
            pending.timings["step_wait_s"] = pending.timings.get("step_wait_s", 0.0) + time.perf_counter() - t0

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, state: dict, async_: bool = True) -> PendingSave:
        step = _step_number(step)
        prev = self._pending
        if prev is not None:
            prev._done.wait()
            prev._copied.wait()    # its snapshot thread is out of the arena too
            if prev._error is not None and not prev.observed:
                prev.observed = True
                raise CheckpointSaveFailed(f"previous checkpoint step {prev.step} did not commit: "
                                           f"{prev._error}") from prev._error
        rank, world = _rank_world()
        t0 = time.perf_counter()
        tensors, values = flatten(state)
        self._prepare_step_dir(step, rank, world, tensors)
        plans = [plan_array(name, tensors[name], rank, world, salt=i, inner_bytes=self.inner_chunk_bytes)
                 for i, name in enumerate(sorted(tensors))]
        plans = gather_small(plans, tensors, rank, world, self.gather_small_bytes, self.inner_chunk_bytes)
        writer = self._ensure_writer()
        prepare_s = time.perf_counter() - t0
        job = {"step": step, "dir": step_dir(step), "rank": rank, "world": world, "fmt": FORMAT,
               "commit_timeout_s": self.commit_timeout_s, "keep_last": self.keep_last,
               "keep_every": self.keep_every, "values": values, "fence": self.fence,
               "background_nice": self.background_nice if async_ else 0, "background": async_,
               "saved_layout": {"world_size": world, "saved_at": _now()},
               "arrays": {p.spec.name: {**p.spec.to_json(), "layout": p.layout} for p in plans}}
        pending = PendingSave(step)
        pending.timings["prepare_s"] = prepare_s     # step dir checked, chunks planned
        if async_ and self._protected:
            pending._ready = _cuda_event(plans)
            # the versions the copy must find: read now, so a change made right after save()
            # returns (before the copy thread runs) is caught too
            copier = threading.Thread(target=self._copy_in_background,
                                      args=(plans, job, pending, writer, _versions(plans)),
                                      name="ckpt-snapshot", daemon=True)
            pending._copied.clear()
            self._pending = pending
            try:
                copier.start()
            except BaseException as exc:   # no thread: nothing would release the save or the arena
                pending._copied.set()
                pending._finish(exc)
                pending.observed = True
                raise
            pending.timings["blocked_s"] = time.perf_counter() - t0
            return pending
        self._pending = pending
        try:
            self._copy(plans, job, pending, writer)
        except BaseException:
            pending.observed = True     # raised here; the writer fails the save too
            raise
        pending.timings["blocked_s"] = time.perf_counter() - t0
        if not async_:
            pending.wait()
        return pending

    def _copy(self, plans: list, job: dict, pending: PendingSave, writer, ready=None,
              versions: list | None = None) -> None:
        """Hand ``job`` to ``writer``, then snapshot the chunks this rank writes into the arena,
        telling the writer as the copy goes (it writes what is copied meanwhile). ``ready``: on
        the snapshot thread, the CUDA event its own stream waits for (see ``protect``)."""
        if versions is None:
            versions = _versions(plans)
        owned = [(p, v) for p, v in zip(plans, versions) if p.owned]
        try:
            job["slots"], copies = snapshot.reserve(plans, self._arena)
            job["arena_size"] = self._arena.size
            writer.submit(job, pending)
        except BaseException as exc:
            fail_part(self.storage, job, f"rank {job['rank']} could not hand its part to its writer: "
                                         f"{type(exc).__name__}: {exc}")   # the others stop waiting now
            pending._finish(exc)     # it never reached the writer: nothing else would finish it
            raise
        try:
            cuda = next((p.local.device for p, _ in owned if p.local.device.type == "cuda"), None)
            if cuda is not None and ready is not None:
                torch.cuda.set_device(cuda)
                side = torch.cuda.Stream(cuda)
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    snapshot.fill(copies, self._arena, on_progress=writer.copied)
            else:
                snapshot.fill(copies, self._arena, on_progress=writer.copied)
            changed = [p.spec.name for p, v in owned if _version(p.local) != v]
            if changed:
                raise CheckpointSaveFailed(
                    f"step {job['step']}: {len(changed)} tensors (first {changed[0]!r}) changed in place "
                    "while their snapshot was taken; with protect(optimizer), nothing but that "
                    "optimizer's step() may change the state until the save's copy is done")
        except BaseException as exc:
            writer.copy_failed(f"{type(exc).__name__}: {exc}")
            raise
        writer.copied(len(job["slots"]), complete=True)

    def _copy_in_background(self, plans: list, job: dict, pending: PendingSave, writer, versions) -> None:
        try:
            self._copy(plans, job, pending, writer, pending._ready, versions)
        except BaseException as exc:  # noqa: BLE001 - the writer fails the save: raised at wait() / next save()
            log.warning("ckpt_snapshot_failed", step=job["step"], error=str(exc))
        finally:
            pending._copied.set()

    def _ensure_writer(self):
        if self._writer is None:
            self._arena = snapshot.HostArena()
            if self._writer_kind == "process":
                self._writer = ProcessWriter(self.storage, self._arena, self._writer_config)
            else:
                self._writer = ThreadWriter(self.storage, self._arena)
            weakref.finalize(self, _close_writer, self._writer, self._arena)
        return self._writer

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (None before the first save, or with a thread writer)."""
        return getattr(self._writer, "pid", None)

    def _prepare_step_dir(self, step: int, rank: int, world: int, tensors: dict) -> None:
        """Refuse a committed step; rank 0 clears leftovers of an earlier failed attempt.

        Runs in the caller's thread; the layout agreement (one all-reduce on the
        default group, foreground) keeps the other ranks from writing before the
        leftovers are gone, and refuses, on every rank, a save whose ranks differ
        in step or arrays (``_agree_layout``).
        """
        d = step_dir(step)
        if self.storage.exists(f"{d}/manifest.json"):
            raise CheckpointError(f"checkpoint step {step} is already committed under {self.url}; "
                                  "save under a new step number")
        if rank == 0:
            if self.storage.list_dir(d):
                log.info("ckpt_clear_leftover", step=step)
                self.storage.delete_prefix(d)
            newer = next((s for s in reversed(all_step_dirs(self.storage)) if s > step
                          and self.storage.exists(f"{step_dir(s)}/manifest.json")), None)
            if newer is not None:
                log.warning("ckpt_save_below_newest", step=step, newest=newer,
                            hint="load() with no step picks the newest committed step while it exists; "
                                 "retention keeps it and this run's latest; delete the newer steps "
                                 "if this run replaces them")
        if world > 1:
            _agree_layout(step, tensors)

    def wait(self) -> None:
        """Wait for the save in flight, if any (raises if it failed)."""
        if self._pending is not None:
            self._pending.wait()

    # -- read side -------------------------------------------------------------------------
    def _all_step_dirs(self) -> list[int]:
        return all_step_dirs(self.storage)

    def steps(self) -> list[int]:
        return committed_steps(self.storage)

    def latest(self) -> int | None:
        for s in reversed(self.steps()):
            try:
                read_manifest(self.storage, step_dir(s))
                return s
            except CheckpointFormatUnsupported:
                raise     # a newer marind's step: never fall back past it silently
            except CheckpointError:
                continue
        return None

    def manifest(self, step: int) -> dict:
        return read_manifest(self.storage, step_dir(step))

    def load(self, state: dict, step: int | None = None) -> dict:
        if self._pending is not None:
            self._pending._copied.wait()   # a snapshot still reading tensors that load may fill
        rank, _ = _rank_world()
        if step is not None:
            self.last_load_stats = load_step(self.storage, step_dir(step), state, rank)
            return state
        candidates = list(reversed(_rank0_steps(self.steps if rank == 0 else None)))
        if not candidates:
            raise CheckpointNotFound(f"no committed checkpoint under {self.url}")
        for s in candidates:
            error = fatal = None
            outcome = LOAD_OK
            try:
                self.last_load_stats = load_step(self.storage, step_dir(s), state, rank)
            except CheckpointNotFound as exc:    # deleted meanwhile (retention): skip, nothing to uncommit
                error, outcome = exc, LOAD_GONE
            except CheckpointCorrupt as exc:
                error, outcome = exc, LOAD_CORRUPT
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
                fatal, outcome = exc, LOAD_FATAL
            outcome = _agree(outcome)
            if outcome == LOAD_OK:
                return state
            if outcome == LOAD_FATAL:
                if fatal is not None:
                    raise fatal
                raise CheckpointError(f"checkpoint step {s} failed to load on another rank (see its log)")
            why = str(error or ("corrupt on another rank" if outcome == LOAD_CORRUPT else "gone on another rank"))
            warnings.warn(f"skipping checkpoint step {s}: {why}", stacklevel=2)
            log.warning("ckpt_skip_step", step=s, error=why)
            if outcome == LOAD_CORRUPT:
                self._quarantine(s, rank, why)
        raise CheckpointNotFound(f"no committed checkpoint under {self.url} loads clean "
                                 f"(tried steps {candidates})")

    def _quarantine(self, step: int, rank: int, reason: str) -> None:
        """Uncommit a step that failed its checksums, so it is never chosen again.

        A run that falls back to an older step will reach this step number again
        and must be able to save it. Rank 0 keeps the old manifest as
        ``manifest.corrupt.json`` (evidence for an operator) and removes
        ``manifest.json``; the rest of the directory becomes an uncommitted
        leftover. All ranks wait for it (foreground, default group).
        """
        d = step_dir(step)
        if rank == 0:
            try:
                self._uncommit(d, reason)
                log.warning("ckpt_quarantined", step=step, reason=reason)
            except Exception as exc:  # noqa: BLE001 - a read-only store: the older steps are still tried
                log.warning("ckpt_quarantine_failed", step=step, error=f"{type(exc).__name__}: {exc}")
        if _distributed():
            dist.barrier()

    def _uncommit(self, d: str, reason: str) -> None:
        if not self.storage.exists(f"{d}/manifest.json"):
            return    # gone already (retention, or another reader quarantined it)
        try:
            manifest = self.storage.read_json(f"{d}/manifest.json")
        except Exception:  # noqa: BLE001 - a corrupt manifest is itself the reason
            manifest = None
        self.storage.write_json_atomic(f"{d}/manifest.corrupt.json",
                                       {"reason": reason, "at": _now(), "manifest": manifest})
        self.storage.delete_prefix(f"{d}/manifest.json")

    def load_arrays(self, state: dict, step: int) -> dict:
        """Fill only the tensors of ``state`` (no JSON values), from ``step``; for tools."""
        self.last_load_stats = load_step(self.storage, step_dir(step), state, 0, values=False)
        return state

    def verify(self, step: int) -> VerifyReport:
        from ckpt_store.loader import verify_step
        problems, count, nbytes = verify_step(self.storage, step_dir(step))
        return VerifyReport(step, not problems, problems, count, nbytes)

    # -- retention -------------------------------------------------------------------------
    def apply_retention(self, in_flight: set[int] | None = None) -> list[int]:
        return apply_retention(self.storage, self.keep_last, self.keep_every, in_flight)

    def close(self) -> None:
        """Wait for the save in flight, stop the writer; raises if the last save failed and
        nobody has seen that yet (a run must not end as if its last checkpoint were safe)."""
        pending = self._pending
        if pending is not None:
            pending._done.wait()
            pending._copied.wait()
        if self._writer is not None:
            _close_writer(self._writer, self._arena)
            self._writer = None
        self.storage.close()
        if pending is not None and pending._error is not None and not pending.observed:
            pending.observed = True
            raise CheckpointSaveFailed(f"checkpoint step {pending.step} did not commit: "
                                       f"{pending._error}") from pending._error


def _close_writer(writer, arena) -> None:
    writer.close()
    arena.close()


def _writer_kind(writer: str, storage: Storage, storage_options) -> str:
    if writer not in ("auto", "process", "thread"):
        raise ValueError(f"writer={writer!r}: use 'auto', 'process' or 'thread'")
    protocols = storage.fs.protocol if isinstance(storage.fs.protocol, tuple) else (storage.fs.protocol,)
    if "memory" in protocols:
        if writer == "process":
            raise ValueError("writer='process' cannot write a memory:// store (it lives in this process)")
        return "thread"
    if writer == "auto":
        try:
            json.dumps(storage_options)
        except (TypeError, ValueError):
            return "thread"
        return "process"
    return writer


def _versions(plans: list) -> list:
    return [_version(p.local) for p in plans]


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); None where it has none."""
    try:
        return t._version
    except RuntimeError:   # an inference-mode tensor
        return None


def _cuda_event(plans: list):
    """An event on the current CUDA stream, which the snapshot thread's stream waits for:
    the copies must see every kernel queued before save(). None without CUDA sources."""
    device = next((p.local.device for p in plans if p.owned and p.local.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


LOAD_OK, LOAD_GONE, LOAD_CORRUPT, LOAD_FATAL = 0, 1, 2, 3   # a step's load; the worst over the ranks wins


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def _agree(outcome: int) -> int:
    """The worst ``outcome`` over all ranks (foreground, default group): every rank then
    takes the same branch (return, try an older step, or raise)."""
    if not _distributed():
        return outcome
    flag = torch.tensor([outcome], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _layout_rows(step: int, tensors: dict) -> list:
    """What every rank of a save must agree on: the step, and each array's name, global
    shape, dtype, mesh shape and placements (not the mesh's ranks: sibling sub-meshes differ)."""
    rows: list = [step]
    for name in sorted(tensors):
        t = tensors[name]
        where = None
        if isinstance(t, DTensor):
            where = [list(mesh_ranks(t.device_mesh)[1]), [str(p) for p in t.placements]]
        rows.append([name, list(t.shape), str(t.dtype), where])
    return rows


def _agree_layout(step: int, tensors: dict) -> None:
    """Refuse, on every rank and before anything is written, a save whose ranks disagree.

    One all-reduce of a 62-bit digest of ``_layout_rows``; only when the digests
    differ do the ranks exchange the rows themselves, to name the difference.
    Ranks that save different steps, or hold different arrays (a pipeline
    stage's own layers: not supported, every rank must hold every array, sharded
    or replicated), would otherwise commit a checkpoint with holes, or wait on
    each other in a collective that never matches.
    """
    rows = _layout_rows(step, tensors)
    raw = json.dumps(rows).encode()
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") >> 2
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    if int(both[0]) == -int(both[1]):
        return
    raise CheckpointError(f"checkpoint step {step}: the ranks disagree on what they save "
                          f"({_layout_difference(_all_gather_json(rows))}); every rank must call save() "
                          "with the same step and the same arrays (shapes, dtypes, placements)")


def _layout_difference(per_rank: list) -> str:
    steps = {r: rows[0] for r, rows in enumerate(per_rank)}
    if len(set(steps.values())) > 1:
        return f"steps by rank: {steps}"
    tables = [{row[0]: row[1:] for row in rows[1:]} for rows in per_rank]
    for name in sorted(set().union(*tables)):
        holders = [r for r, table in enumerate(tables) if name in table]
        if len(holders) < len(tables):
            return f"array {name!r} is held by ranks {holders} only"
        kinds = {json.dumps(table[name]) for table in tables}
        if len(kinds) > 1:
            first = tables[0][name]
            other = next(r for r, table in enumerate(tables) if table[name] != first)
            return f"array {name!r} is {first} on rank 0 but {tables[other][name]} on rank {other}"
    return "their digests differ"


def _all_gather_json(obj) -> list:
    """Every rank's ``obj`` (JSON), through two all-gathers of byte tensors (no pickle)."""
    device = _collective_device()
    data = json.dumps(obj).encode()
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = max(int(s) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s)].cpu().tolist())) for b, s in zip(bufs, sizes)]


def _rank0_steps(list_steps) -> list[int]:
    """Rank 0's committed steps, on every rank (``list_steps``: rank 0's lister, None elsewhere).

    One listing for the whole job instead of one per rank (on S3 a LIST plus a HEAD per
    step, times every rank), and every rank then tries the same steps in the same order:
    listings taken a moment apart can differ, and a load whose ranks walk different lists
    would leave some of them waiting in a collective. A listing that fails on rank 0 is
    raised on every rank."""
    if not _distributed():
        return list_steps()
    device = _collective_device()
    steps, error = [], None
    if list_steps is not None:
        try:
            steps = list_steps()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
    count = torch.tensor([-1 if error is not None else len(steps)], dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    if int(count.item()) < 0:
        if error is not None:
            raise error
        raise CheckpointError("rank 0 could not list the checkpoint steps (see its log)")
    buf = torch.tensor(steps if list_steps is not None else [0] * int(count.item()), dtype=torch.int64,
                       device=device)
    if buf.numel():
        dist.broadcast(buf, src=0)
    return [int(s) for s in buf.tolist()]


def _integer(value, error: str) -> int:
    """``value`` as a plain int (any integer type, not a bool), or TypeError(``error``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(error)


def _step_number(step) -> int:
    """``step`` as a plain int in the range a step directory can name, or a one-line error."""
    n = _integer(step, f"checkpoint step must be an integer, not {type(step).__name__} {step!r}")
    if not 0 <= n <= MAX_STEP:
        raise ValueError(f"checkpoint step {n} is out of range: use 0 to {MAX_STEP}")
    return n


def _count(name: str, value, minimum: int) -> int | None:
    if value is None:
        return None
    n = _integer(value, f"{name}={value!r}: use an integer >= {minimum} or None")
    if n < minimum:
        raise ValueError(f"{name}={n}: use an integer >= {minimum} or None")
    return n


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


__all__ = ["CheckpointStore", "PendingSave", "VerifyReport", "step_dir", "parse_step_dir"]

"""CheckpointStore: the public API (docs/design.md §4).

Save protocol, per step (the background part uses no torch collectives):

0. in the caller's thread: refuse an already committed step; rank 0 removes leftovers of
   an earlier failed attempt at this step, then one all-reduce on the default group (the
   layout's digest and every rank's readiness: ``agreement.agree_layout``) and, for small
   sharded arrays, one all-gather (``gather.py``);
1. every rank snapshots the chunks it owns into reused host memory shared with its
   writer process (the caller waits only for this; ``snapshot.py``);
2. in the background (the writer process: ``writer_client.py``, ``rank_part.py``) each
   rank encodes and writes its chunk objects and its JSON values, then a done marker
   ``.marind/rank-R.json`` listing its objects (size, crc32c) — or
   ``.marind/error-R.json`` if it failed;
3. rank 0 polls for every rank's marker, writes the Zarr metadata and finally
   ``manifest.json`` (the commit), then applies retention;
4. the other ranks' saves complete when the manifest (or rank 0's abort marker) appears.

A step without ``manifest.json`` does not exist for readers.
"""

from __future__ import annotations

import datetime
import threading
import time
import weakref
from typing import Any

from ckpt_store import agreement
from ckpt_store.errors import (
    CheckpointError,
    CheckpointFormatUnsupported,
    CheckpointSaveFailed,
)
from ckpt_store.format.manifest import FORMAT, read_manifest
from ckpt_store.format.plan import flatten, plan_array
from ckpt_store.format.steps import (
    apply_retention,
    committed_steps,
    parse_step_dir,
    prepare_step,
    retention_count,
    step_dir,
    step_number,
)
from ckpt_store.load.load_newest import load_newest
from ckpt_store.load.loader import load_step
from ckpt_store.load.verify import VerifyReport
from ckpt_store.log import get_logger
from ckpt_store.save import snapshot
from ckpt_store.save.gather import SMALL_ARRAY_BYTES, gather_small
from ckpt_store.save.pending import PendingSave
from ckpt_store.save.save_job import SaveJob, writer_kind
from ckpt_store.save.settle import agree_previous, not_ready, settle_pending
from ckpt_store.save.snapshot_copy import copy_snapshot, cuda_event, tensor_versions
from ckpt_store.save.thread_writer import ThreadWriter
from ckpt_store.save.writer_client import ProcessWriter
from ckpt_store.storage.protocol import Storage, open_storage

log = get_logger(__name__)
#: niceness of an async save's encode/write threads (measured in bench/ckpt_bench.py)
BACKGROUND_NICE = 10


class CheckpointStore:
    """Sharded, async, atomically committed Zarr v3 checkpoints under one URL (see README.md).

    Args:
        url: ``file://``, ``s3://`` or ``memory://`` root (a bare path is a local one).
        storage_options: fsspec options (S3 credentials, endpoint).
        keep_last: retention: keep this many newest committed steps (None: all).
        keep_every: retention: also keep every step divisible by this (None: none).
        commit_timeout_s: how long a save waits for every rank's part and for the commit.
        io_threads: concurrent object reads and writes.
        inner_chunk_bytes: the size of the inner chunks a large shard is split into.
        io_rate_limit: cap background writes at this many bytes/s (None: no cap).
        writer: where uploads run: "process" (a writer process per store, the default for
            file:// and s3://), "thread" (in this process; memory:// needs it), or "auto".
        writer_nice: niceness added to the writer process (yields CPU to training).
        background_nice: niceness added, during async saves only, to the threads that
            encode and write (training keeps the CPU; a sync save, which the caller waits
            for, runs at full priority).
        direct_io: local disks: write chunk objects with O_DIRECT (True: no page cache; falls
            back by itself where the filesystem refuses it), through the page cache (False), or
            "auto" (the default): O_DIRECT for async saves, and for sync saves the path that
            wrote faster on this disk (``write_mode.py``).
        gather_small_bytes: sharded arrays of at most this many bytes are gathered and
            written whole by one rank (one object instead of one per shard; 0: never).
        fence_file: a local JSON file ``{"valid_until": unix_seconds}`` (marind's run
            ``lease.json``): rank 0 writes the manifest only while it leaves
            ``fence_margin_s`` seconds, else the save fails uncommitted, so a world that may
            have been replaced never commits (``ckpt_store.save.fence``). A missing or malformed
            file does not fence.
        fence_margin_s: see ``fence_file``.
        prepare_timeout_s: async saves only: how long ``save()`` waits on the storage calls it
            makes in the caller's thread (the step directory's check); past it, on any rank,
            every rank's ``save()`` raises ``CheckpointSaveFailed`` and nothing is saved, so a
            storage that went silent (a cut network) does not stall training. None: no bound.

    Raises:
        ValueError, TypeError: a retention count, timeout or writer that makes no sense.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, keep_last: int | None = None,
                 keep_every: int | None = None, commit_timeout_s: float = 600.0,
                 io_threads: int = 4, inner_chunk_bytes: int = 1 << 20,
                 io_rate_limit: float | None = None, writer: str = "auto", writer_nice: int = 0,
                 background_nice: int = BACKGROUND_NICE, direct_io: bool | str = "auto",
                 gather_small_bytes: int = SMALL_ARRAY_BYTES, fence_file: str | None = None,
                 fence_margin_s: float = 2.0, prepare_timeout_s: float | None = None):
        self.url = url
        keep_last = retention_count("keep_last", keep_last, minimum=0)
        keep_every = retention_count("keep_every", keep_every, minimum=1)
        if not commit_timeout_s or commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s={commit_timeout_s!r}: use a number of seconds > 0")
        if direct_io not in (True, False, "auto"):
            raise ValueError(f"direct_io={direct_io!r}: use True, False or \"auto\"")
        self.storage: Storage = open_storage(url, storage_options, io_threads=io_threads,
                                             rate_limit=io_rate_limit, direct_io=direct_io)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.commit_timeout_s = commit_timeout_s
        self.fence = (str(fence_file), float(fence_margin_s)) if fence_file else None
        self.prepare_timeout_s = prepare_timeout_s
        self._stale_prepare: threading.Thread | None = None   # a timed-out prepare still waiting on the storage
        self.background_nice = background_nice
        self.inner_chunk_bytes = inner_chunk_bytes
        self.gather_small_bytes = gather_small_bytes
        self._writer_kind = writer_kind(writer, self.storage.in_process, storage_options)
        self._writer_config = {"url": self.storage.url, "storage_options": storage_options,
                               "io_threads": io_threads, "rate_limit": io_rate_limit, "nice": writer_nice,
                               "direct_io": direct_io}
        self._arena: snapshot.HostArena | None = None
        self._writer: ProcessWriter | ThreadWriter | None = None
        self._pending: PendingSave | None = None
        self._settled: tuple[str | None] | None = None   # settle()'s outcome of the last save: save() need not again
        self._protected = False
        self.last_load_stats: dict = {}

    def protect(self, optimizer: Any) -> None:
        """Let async saves copy the state while training goes on, until ``optimizer.step()``.

        An async ``save()`` then returns once the work that needs collectives
        is done; the snapshot copy runs on a thread (torch copies release the
        GIL; CUDA sources copy on a stream of their own) beside the next
        forward and backward, which read the state but do not change it. The
        optimizer's next ``step()`` first waits for the copy (that wait is
        counted in ``timings["step_wait_s"]``). Anything else that changes the
        state in place before then is caught (tensor version counters) and fails
        that save instead of committing a torn checkpoint.

        Args:
            optimizer: the ``torch.optim.Optimizer`` that steps the saved state.

        Raises:
            TypeError: ``optimizer`` takes no step pre-hooks (not a torch optimizer).
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(f"protect() needs a torch.optim.Optimizer, not {type(optimizer).__name__}")
        optimizer.register_step_pre_hook(self._before_step)
        self._protected = True

    def _before_step(self, *_args) -> None:
        if self._pending is not None:
            self._pending.wait_copied(count_as="step_wait_s")

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, state: dict, async_: bool = True) -> PendingSave:
        """Save ``state`` as ``step``; every rank must call it, with the same step and arrays.

        Args:
            step: the step number, an integer from 0 to ``MAX_STEP``, not committed yet.
            state: nested dicts of tensors / DTensors and JSON values.
            async_: return once the snapshot is taken (with ``protect``: once the
                collectives are done); False: once the step committed.

        Returns:
            The save's ``PendingSave``; ``wait()`` on it raises if the save failed.

        Raises:
            CheckpointSaveFailed: the previous save failed and nobody has seen it yet; or,
                with ``async_=False``, this save did not commit.
            CheckpointError: the step is already committed, or the ranks disagree on what
                they save.
            ValueError, TypeError: a bad step number, a value that is not JSON.
        """
        step = step_number(step)
        rank, world = agreement.rank_world()
        agree_previous(self._pending, self._writer, world, self._settled)   # raises its unseen failure
        self._settled = None
        t0 = time.perf_counter()
        tensors, values = flatten(state)
        limit = self.prepare_timeout_s if async_ else None
        self._stale_prepare, failure = prepare_step(self.storage, self.url, step, rank, limit, self._stale_prepare)
        ready = failure is None and self._stale_prepare is None
        # one all-reduce: every rank ready (its prepare done, in time) and saving the same arrays
        if not (agreement.agree_layout(step, tensors, ready) if world > 1 else ready):
            raise not_ready(step, failure, world, limit) from failure     # on every rank, with the first cause
        plans = [plan_array(name, tensors[name], rank, world, salt=i, inner_bytes=self.inner_chunk_bytes)
                 for i, name in enumerate(sorted(tensors))]
        plans = gather_small(plans, tensors, rank, world, self.gather_small_bytes, self.inner_chunk_bytes)
        writer, arena = self._ensure_writer()
        prepare_s = time.perf_counter() - t0
        job = SaveJob(step=step, dir=step_dir(step), rank=rank, world=world, fmt=FORMAT,
                      commit_timeout_s=self.commit_timeout_s, keep_last=self.keep_last,
                      keep_every=self.keep_every, values=values, fence=self.fence,
                      background_nice=self.background_nice if async_ else 0, background=async_,
                      saved_layout={"world_size": world, "saved_at": _now()},
                      arrays={p.spec.name: {**p.spec.to_json(), "layout": p.layout} for p in plans})
        pending = PendingSave(step)
        pending.timings["prepare_s"] = prepare_s     # step dir checked, chunks planned
        if async_ and self._protected:
            pending.cuda_ready = cuda_event(plans)
            # the versions the copy must find: read now, so a change made right after save()
            # returns (before the copy thread runs) is caught too
            copier = threading.Thread(target=self._copy_in_background,
                                      args=(plans, job, pending, writer, arena, tensor_versions(plans)),
                                      name="ckpt-snapshot", daemon=True)
            pending.copy_started()
            self._pending = pending
            try:
                copier.start()
            except BaseException as exc:   # no thread: nothing would release the save or the arena
                pending.copy_finished()
                pending.finish(exc)
                pending.mark_observed()
                raise
            pending.timings["blocked_s"] = time.perf_counter() - t0
            return pending
        self._pending = pending
        try:
            copy_snapshot(self.storage, arena, plans, job, pending, writer)
        except BaseException:
            pending.mark_observed()     # raised here; the writer fails the save too
            raise
        pending.timings["blocked_s"] = time.perf_counter() - t0
        if not async_:
            agreed = self.settle() if world > 1 else None     # its outcome, the same on every rank
            if agreed is not None:
                pending.mark_observed()
                raise CheckpointSaveFailed(f"checkpoint step {step} did not commit: {agreed}")
            pending.wait()
        return pending

    def settle(self, timeout_s: float | None = None, give_up_s: float | None = None) -> str | None:
        """Wait until the save in flight is over on every rank, and agree on its outcome.

        Collective with more than one rank (every rank calls it, with a save in flight or not).
        A save that failed on any rank fails on every rank: the ranks still in it stop (rank 0
        never commits it), and each learns the first failing rank's error (``save.settle``).
        Its failure still counts as unseen (``wait()``, the next ``save()``).

        Args:
            timeout_s: raise ``TimeoutError`` (on every rank) once some rank waited this long.
            give_up_s: return ``"busy"`` (on every rank) once some rank waited this long.

        Returns:
            None: committed everywhere, or no save; ``"busy"``; else the agreed failure in words.
        """
        outcome = settle_pending(self._pending, self._writer, timeout_s, give_up_s)
        self._settled = None if outcome == agreement.SETTLE_BUSY else (outcome,)
        return outcome

    def _copy_in_background(self, plans: list, job: SaveJob, pending: PendingSave, writer, arena,
                            versions: list) -> None:
        try:
            copy_snapshot(self.storage, arena, plans, job, pending, writer, pending.cuda_ready, versions)
        except BaseException as exc:  # noqa: BLE001 - the writer fails the save: raised at wait() / next save()
            log.warning("ckpt_snapshot_failed", step=job.step, error=str(exc))
        finally:
            pending.copy_finished()

    def _ensure_writer(self) -> tuple[ProcessWriter | ThreadWriter, snapshot.HostArena]:
        if self._writer is None or self._arena is None:
            self._arena = snapshot.HostArena()
            if self._writer_kind == "process":
                self._writer = ProcessWriter(self.storage, self._arena, self._writer_config)
            else:
                self._writer = ThreadWriter(self.storage, self._arena)
            weakref.finalize(self, _close_writer, self._writer, self._arena)
        return self._writer, self._arena

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (None before the first save, or with a thread writer)."""
        return getattr(self._writer, "pid", None)

    @property
    def pending_step(self) -> int | None:
        """The step of the last save this store started (in flight or over); None before any."""
        return self._pending.step if self._pending is not None else None

    def wait(self) -> None:
        """Wait for the save in flight, if any; raises ``CheckpointSaveFailed`` if it did not commit."""
        if self._pending is not None:
            self._pending.wait()

    # -- read side -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps (those with a manifest, readable or not), oldest first."""
        return committed_steps(self.storage)

    def latest(self) -> int | None:
        """The newest committed step whose manifest reads clean; None if there is none.

        Raises:
            CheckpointFormatUnsupported: the newest readable step was written by a newer
                ckpt_store (never skipped silently).
        """
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
        """``step``'s manifest (arrays, objects, saved layout).

        Args:
            step: a committed step.

        Returns:
            The manifest, decoded.

        Raises:
            CheckpointNotFound: no committed ``step``.
            CheckpointCorrupt: the manifest is malformed.
            CheckpointFormatUnsupported: a newer checkpoint format.
        """
        return read_manifest(self.storage, step_dir(step))

    def load(self, state: dict, step: int | None = None) -> dict:
        """Fill ``state``'s tensors in place (and its JSON values) from a checkpoint.

        Collective in an initialized group of more than one rank, with or without ``step``:
        every rank must call it (the ranks all-gather their shares of the step's object lists;
        with no ``step`` they also agree on each step tried). A tool reading on one rank uses
        ``load_arrays`` (or ``ckpt_store.export.read_values``), which read alone.
        Only the chunks intersecting this rank's pieces are read, and every inner
        chunk's crc32c is checked; ``last_load_stats`` says how much was read.

        Args:
            state: the target: nested dicts of tensors / DTensors in the current layout.
            step: the step to load; None: the newest committed step that loads clean
                (corrupt ones are skipped with a warning and quarantined).

        Returns:
            ``state``, filled.

        Raises:
            CheckpointNotFound: no committed step (or none that loads clean).
            CheckpointCorrupt: the given ``step`` is damaged.
            CheckpointMismatch: ``state`` does not match the checkpoint (every bad key listed).
            CheckpointFormatUnsupported: a newer checkpoint format.
            CheckpointError: the load failed on another rank.
        """
        if self._pending is not None:
            self._pending.wait_copied()   # a snapshot still reading tensors that load may fill
        rank, _ = agreement.rank_world()
        share = agreement.part_share()    # W reads of the steps' object lists per job, not W x W
        if step is not None:
            self.last_load_stats = load_step(self.storage, step_dir(step), state, rank, share=share)
            return state
        self.last_load_stats = load_newest(self.storage, state, rank, share)
        return state

    def load_arrays(self, state: dict, step: int) -> dict:
        """Fill only the tensors of ``state`` (no JSON values) from ``step``, as rank 0; for tools.
        No collectives: this process reads every object list itself.

        Args:
            state: the target tensors (nested dicts), in any layout.
            step: a committed step.

        Returns:
            ``state``, filled.

        Raises:
            CheckpointNotFound, CheckpointCorrupt, CheckpointMismatch: as ``load`` with a step.
        """
        self.last_load_stats = load_step(self.storage, step_dir(step), state, 0, values=False)
        return state

    def verify(self, step: int) -> VerifyReport:
        """Read every object of ``step`` and check its size and checksums.

        Args:
            step: the step to check (committed, readable or not).

        Returns:
            A ``VerifyReport``: ``ok``, and the problems found (an unreadable manifest is one).
        """
        from ckpt_store.load.verify import verify_step
        problems, count, nbytes = verify_step(self.storage, step_dir(step))
        return VerifyReport(step, not problems, problems, count, nbytes)

    # -- retention -------------------------------------------------------------------------
    def apply_retention(self, in_flight: set[int] | None = None) -> list[int]:
        """Delete the steps ``keep_last``/``keep_every`` do not keep, and uncommitted leftovers.

        Args:
            in_flight: steps being saved right now (their leftovers stay).

        Returns:
            The steps deleted.
        """
        return apply_retention(self.storage, self.keep_last, self.keep_every, in_flight)

    def close(self) -> None:
        """Wait for the save in flight, stop the writer and the I/O threads.

        Raises:
            CheckpointSaveFailed: the last save failed and nobody has seen that yet (a run
                must not end as if its last checkpoint were safe).
        """
        pending = self._pending
        if pending is not None:
            pending.settle()
        if self._writer is not None and self._arena is not None:
            _close_writer(self._writer, self._arena)
            self._writer = None
        self.storage.close()
        error = pending.unreported_error() if pending is not None else None
        if pending is not None and error is not None:
            raise CheckpointSaveFailed(f"checkpoint step {pending.step} did not commit: "
                                       f"{error}") from error


def _close_writer(writer, arena) -> None:
    writer.close()
    arena.close()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


__all__ = ["CheckpointStore", "PendingSave", "VerifyReport", "step_dir", "parse_step_dir"]

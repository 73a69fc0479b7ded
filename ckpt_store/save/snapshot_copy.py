"""The caller's side of a save's snapshot: hand the job to the writer, then copy, then check.

``copy_snapshot`` lays out the slots (``snapshot.reserve``), submits the job
to the writer before anything is copied, copies the owned chunks into the
arena telling the writer how far it got (``handoff.py``: the writer writes
each slot once it is copied), then checks that no tensor changed in place
meanwhile and only then declares the copy complete. A copy that fails
partway fails the save on every rank (the writer writes the error marker).
With ``protect(optimizer)`` an async save runs this on a thread, on a CUDA
stream of its own that waits for ``cuda_ready`` (recorded at ``save()``).
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.save import snapshot
from ckpt_store.save.commit import fail_part
from ckpt_store.save.pending import PendingSave
from ckpt_store.save.save_job import SaveJob, SaveWriter


def copy_snapshot(storage: Any, arena: snapshot.HostArena, plans: list, job: SaveJob, pending: PendingSave,
                  writer: SaveWriter, ready: Any = None, versions: list | None = None) -> None:
    """Hand ``job`` to ``writer``, then snapshot the chunks this rank writes into ``arena``,
    telling the writer as the copy goes (it writes what is copied meanwhile).

    Args:
        storage: the store's storage (for the error marker when the writer cannot take the job).
        arena: the snapshot memory shared with the writer.
        plans: this rank's ``plan.ArrayPlan`` of every array.
        job: the save job, without its slots (laid out here).
        pending: the save's handle (finished here if the job never reached the writer).
        writer: the store's writer (process or thread).
        ready: on the snapshot thread, the CUDA event its own stream waits for.
        versions: the tensors' version counters the copy must find (default: read now).

    Raises:
        CheckpointSaveFailed: a tensor changed in place while it was copied.
        Whatever the hand-off or the copy raised (the save fails on every rank).
    """
    if versions is None:
        versions = tensor_versions(plans)
    owned = [(p, v) for p, v in zip(plans, versions) if p.owned]
    try:
        slots, copies = snapshot.reserve(plans, arena)
        job = job.with_slots(slots, arena.size)
        writer.submit(job, pending)
    except BaseException as exc:
        fail_part(storage, job, f"rank {job.rank} could not hand its part to its writer: "
                                f"{type(exc).__name__}: {exc}")   # the others stop waiting now
        pending.finish(exc)     # it never reached the writer: nothing else would finish it
        raise
    try:
        cuda = next((p.local.device for p, _ in owned if p.local.device.type == "cuda"), None)
        if cuda is not None and ready is not None:
            torch.cuda.set_device(cuda)
            side = torch.cuda.Stream(cuda)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                snapshot.fill(copies, arena, on_progress=writer.copied)
        else:
            snapshot.fill(copies, arena, on_progress=writer.copied)
        changed = [p.spec.name for p, v in owned if tensor_version(p.local) != v]
        if changed:
            raise CheckpointSaveFailed(
                f"step {job.step}: {len(changed)} tensors (first {changed[0]!r}) changed in place "
                "while their snapshot was taken; with protect(optimizer), nothing but that "
                "optimizer's step() may change the state until the save's copy is done")
    except BaseException as exc:
        writer.copy_failed(f"{type(exc).__name__}: {exc}")
        raise
    writer.copied(len(job.slots), complete=True)


def tensor_versions(plans: list) -> list:
    """The version counter of each plan's local tensor (see ``tensor_version``)."""
    return [tensor_version(p.local) for p in plans]


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); None where it has none."""
    try:
        return t._version
    except RuntimeError:   # an inference-mode tensor
        return None


def cuda_event(plans: list) -> Any:
    """An event on the current CUDA stream, which the snapshot thread's stream waits for:
    the copies must see every kernel queued before save(). None without CUDA sources."""
    device = next((p.local.device for p in plans if p.owned and p.local.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event

"""The ranks agree on the outcome of the save in flight before the next one (``CheckpointStore.settle``).

A save's background part can fail on one rank only (its disk filled, its uploads ran out of
retries) while the others wait for a commit that will not come: the failing rank's error
marker may not even fit on a full disk. Left alone, the ranks part ways: one enters the next
save's collectives while another still waits for the old commit. So before a save (and for a
sync save, before it returns) every rank runs ``settle_pending``: rounds of one all-reduce of
(failed, running, gave up, timed out) until the flags decide (``agreement.settle_decision``).
A failure anywhere is a failure everywhere: the ranks still in the save stop it (the writer's
``cancel``: it stops writing, or waiting for the commit, and fails, so rank 0 never commits
it), and every rank learns the first failing rank's error (one all-gather, only then). No
torch here beyond ``agreement``'s collectives.
"""

from __future__ import annotations

import time

from ckpt_store import agreement
from ckpt_store.errors import CheckpointError, CheckpointSaveFailed, CheckpointStorageUnavailable
from ckpt_store.save.pending import PendingSave
from ckpt_store.save.save_job import SaveWriter


def settle_pending(pending: PendingSave | None, writer: SaveWriter | None, timeout_s: float | None = None,
                   give_up_s: float | None = None) -> str | None:
    """Wait with every rank until the save in flight is over everywhere, and agree on its outcome.

    Every rank must call it (with or without a save in flight: None counts as over).

    Args:
        pending: this rank's save in flight (or its last save), None for none.
        writer: the store's writer (stops this rank's part when another rank failed).
        timeout_s: raise ``TimeoutError`` on every rank once some rank waited this long.
        give_up_s: return ``agreement.SETTLE_BUSY`` on every rank once some rank waited this
            long with the save still running somewhere (its caller skips a save rather than wait).

    Returns:
        None: the save committed on every rank (or there was none); ``SETTLE_BUSY``; or the failure
        every rank agreed on, in words (``rank R: error``), the same on every rank.

    Raises:
        TimeoutError: the save is still running somewhere after ``timeout_s``, on every rank.
    """
    t0 = time.monotonic()

    def local() -> tuple[bool, bool, bool, bool]:
        if pending is None:
            return False, False, False, False
        waited = time.monotonic() - t0
        return (pending.failed(), not pending.done(), give_up_s is not None and waited >= give_up_s,
                timeout_s is not None and waited >= timeout_s)

    decision = agreement.agree_settled(local)
    if decision == agreement.SETTLE_BUSY:
        return agreement.SETTLE_BUSY
    if decision == agreement.SETTLE_TIMEOUT:
        step = pending.step if pending is not None else "?"
        raise TimeoutError(f"checkpoint step {step} was still being saved on some rank after {timeout_s:g}s")
    if decision == agreement.SETTLED:
        if pending is not None:
            pending.settle()       # its copy too
        return None
    mine = pending.error_text() if pending is not None else None
    texts = agreement.all_gather_json(mine) if agreement.distributed() else [mine]
    rank, text = next(((r, t) for r, t in enumerate(texts) if t), (0, "failed"))
    agreed = f"rank {rank}: {text}" if len(texts) > 1 else text
    if pending is not None and not pending.done() and writer is not None:
        writer.cancel(pending.step, f"checkpoint step {pending.step} failed on {agreed}")
    if pending is not None:
        pending.settle()           # the writer stops at its next poll; the arena is then free
    return agreed


def agree_previous(prev: PendingSave | None, writer: SaveWriter | None, world: int,
                   settled: tuple[str | None] | None) -> None:
    """Before a save: the previous one is over on every rank (``settle_pending``, unless the
    caller settled it already: ``settled`` holds that outcome), and a failure of it that nobody
    has seen yet is raised on every rank (where any rank has not seen it: one all-reduce, only
    after a failure, which every rank agreed on).

    Raises:
        CheckpointSaveFailed: the previous save failed and some rank has not seen it.
    """
    agreed = (settled[0] if settled is not None else settle_pending(prev, writer)) if world > 1 else None
    if prev is None:
        return
    prev.settle()     # its snapshot thread is out of the arena too
    if not (agreed is not None if world > 1 else prev.failed()):
        return
    error = prev.unreported_error()
    if (not agreement.all_ranks_ok(error is None)) if world > 1 else error is not None:
        raise CheckpointSaveFailed(f"previous checkpoint step {prev.step} did not commit: "
                                   f"{error or agreed or prev.error_text()}") from error


def not_ready(step: int, failure: BaseException | None, world: int, bound: float | None) -> BaseException:
    """What every rank raises when some rank's step-directory check (``steps.prepare_step``) failed
    or did not finish within ``bound``: this rank's own ``CheckpointError`` (a step committed
    already), else ``CheckpointSaveFailed`` naming the first rank's cause, which every rank learns
    (one all-gather, every rank takes this branch alike): a full disk named on every rank.
    """
    mine = f"{type(failure).__name__}: {failure}" if failure is not None else None
    texts = agreement.all_gather_json(mine) if world > 1 else [mine]
    if isinstance(failure, CheckpointError) and not isinstance(failure, CheckpointStorageUnavailable):
        return failure                               # e.g. the step is committed already
    cause = next((f"rank {r}: {t}" for r, t in enumerate(texts) if t), None)
    within = f"within {bound:g}s " if bound is not None else ""
    return CheckpointSaveFailed(f"checkpoint step {step} not saved: " + (
        f"the storage failed on {cause}" if cause else f"the storage did not answer {within}on some rank"))


__all__ = ["agree_previous", "not_ready", "settle_pending"]

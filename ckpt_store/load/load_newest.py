"""Loading the newest committed step that loads clean, on every rank alike (docs/design.md §4).

Rank 0 alone lists the committed steps and broadcasts them, so every rank
walks the same list; all ranks agree on each tried step's outcome (one
all-reduce); a step deleted meanwhile is skipped, a corrupt one is skipped
with a warning and quarantined (its manifest moved to
``manifest.corrupt.json``, best effort), and any other error on any rank is
raised on every rank.
"""

from __future__ import annotations

import datetime
import warnings

from ckpt_store import agreement
from ckpt_store.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from ckpt_store.format.manifest import PartShare
from ckpt_store.format.steps import committed_steps, step_dir
from ckpt_store.load.loader import load_step
from ckpt_store.log import get_logger
from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)


def load_newest(storage: Storage, state: dict, rank: int, share: PartShare | None = None) -> dict:
    """Fill ``state`` from the newest committed step that loads clean on every rank.

    Args:
        storage: the store's storage.
        state: the target (see ``CheckpointStore.load``).
        rank: this rank.
        share: the ranks share the reading of each tried step's object lists (``read_manifest``).

    Returns:
        The load's stats ({bytes_read, bytes_needed, objects}).

    Raises:
        CheckpointNotFound: no committed step, or none loads clean.
        CheckpointError: a step failed to load on another rank (that rank raises its error).
        Any other error of the load, on the rank that had it.
    """
    lister = (lambda: committed_steps(storage)) if rank == 0 else None
    candidates = list(reversed(agreement.rank0_steps(lister)))
    if not candidates:
        raise CheckpointNotFound(f"no committed checkpoint under {storage.url}")
    for s in candidates:
        error: CheckpointError | None = None
        fatal: Exception | None = None
        outcome = agreement.LOAD_OK
        try:
            stats = load_step(storage, step_dir(s), state, rank, share=share)
        except CheckpointNotFound as exc:    # deleted meanwhile (retention): skip, nothing to uncommit
            error, outcome = exc, agreement.LOAD_GONE
        except CheckpointCorrupt as exc:
            error, outcome = exc, agreement.LOAD_CORRUPT
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            fatal, outcome = exc, agreement.LOAD_FATAL
        outcome = agreement.agree_outcome(outcome)
        if outcome == agreement.LOAD_OK:
            return stats
        if outcome == agreement.LOAD_FATAL:
            if fatal is not None:
                raise fatal
            raise CheckpointError(f"checkpoint step {s} failed to load on another rank (see its log)")
        why = str(error or ("corrupt on another rank" if outcome == agreement.LOAD_CORRUPT
                            else "gone on another rank"))
        warnings.warn(f"skipping checkpoint step {s}: {why}", stacklevel=3)
        log.warning("ckpt_skip_step", step=s, error=why)
        if outcome == agreement.LOAD_CORRUPT:
            quarantine(storage, s, rank, why)
    raise CheckpointNotFound(f"no committed checkpoint under {storage.url} loads clean "
                             f"(tried steps {candidates})")


def quarantine(storage: Storage, step: int, rank: int, reason: str) -> None:
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
            _uncommit(storage, d, reason)
            log.warning("ckpt_quarantined", step=step, reason=reason)
        except Exception as exc:  # noqa: BLE001 - a read-only store: the older steps are still tried
            log.warning("ckpt_quarantine_failed", step=step, error=f"{type(exc).__name__}: {exc}")
    agreement.barrier()


def _uncommit(storage: Storage, d: str, reason: str) -> None:
    if not storage.exists(f"{d}/manifest.json"):
        return    # gone already (retention, or another reader quarantined it)
    try:
        manifest = storage.read_json(f"{d}/manifest.json")
    except Exception:  # noqa: BLE001 - a corrupt manifest is itself the reason
        manifest = None
    at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    storage.write_json_atomic(f"{d}/manifest.corrupt.json", {"reason": reason, "at": at, "manifest": manifest})
    storage.delete_prefix(f"{d}/manifest.json")

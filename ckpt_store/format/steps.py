"""Step directories under a store root: names, listing, committed steps, retention applied.

Torch-free (the writer process applies retention after it commits).
"""

from __future__ import annotations

import operator
import threading
import uuid
from typing import TYPE_CHECKING, Any

from ckpt_store.errors import CheckpointError
from ckpt_store.format import retention
from ckpt_store.log import get_logger

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)
MANIFEST = "manifest.json"
TRASH = ".deleted-"   # a deleted step renamed out of sight, its files removed right after
MAX_STEP = 10**10 - 1   # step directories name the step in 10 digits


def step_dir(step: int) -> str:
    """The directory name of ``step`` (``step-`` and ten digits)."""
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name names; None for any other name."""
    if name.startswith("step-") and name[5:].isdigit() and len(name) == 15:
        return int(name[5:])
    return None


def all_step_dirs(st: Storage) -> list[int]:
    """Every step directory under the root (committed or not), oldest first."""
    return sorted(s for s in map(parse_step_dir, st.list_dir("")) if s is not None)


def committed_steps(st: Storage) -> list[int]:
    """The steps with a manifest, oldest first."""
    return [s for s in all_step_dirs(st) if st.exists(f"{step_dir(s)}/{MANIFEST}")]


def apply_retention(st: Storage, keep_last: int | None, keep_every: int | None,
                    in_flight: set[int] | None = None, trash: list | None = None,
                    keep: set[int] | None = None) -> list[int]:
    """Delete steps past ``keep_last``/``keep_every`` and uncommitted leftovers; returns them.
    ``keep``: committed steps never deleted here (the step just committed).

    With ``trash`` (a list), a doomed step is uncommitted here and its objects
    are left for the caller to remove once the save that triggered retention has
    been reported (so a save's time never includes deleting an old one): on a
    local disk the step is renamed to ``.deleted-...`` (instant; also any such
    names a crash left behind are collected), on an object store its key is
    appended as it is (a crash before the caller deletes it leaves an
    uncommitted step, which the next retention removes as a leftover).
    """
    committed = committed_steps(st)
    doomed = retention.steps_to_delete(committed, keep_last, keep_every, keep or set())
    doomed += retention.leftovers_to_delete(all_step_dirs(st), committed, in_flight or set())
    for s in doomed:
        d = step_dir(s)
        if st.exists(f"{d}/{MANIFEST}"):
            st.delete_prefix(f"{d}/{MANIFEST}")  # uncommit first
        if trash is None:
            st.delete_prefix(d)
        elif st.local:
            gone = f"{TRASH}{d}-{uuid.uuid4().hex[:8]}"
            st.rename(d, gone)
            trash.append(gone)
        else:
            trash.append(d)
        log.info("ckpt_deleted", step=s)
    if trash is not None and st.local:
        trash.extend(n for n in st.list_dir("") if n.startswith(TRASH) and n not in trash)
    return sorted(doomed)


#: written by rank 0 before any rank writes; gone at the commit = the step was deleted under its save
BEGIN_MARKER = ".marind/begin.json"


def prepare_step_dir(st: Storage, url: str, step: int, rank: int) -> None:
    """Refuse a committed step; rank 0 clears leftovers of an earlier failed attempt.

    Runs in the caller's thread of ``save()``, before the ranks' layout
    agreement (``agreement.agree_layout``, one all-reduce), which keeps the
    other ranks from writing before the leftovers are gone. Rank 0 also warns
    when the step is below the newest committed one (a run resumed from an
    older step: retention keeps both).

    Args:
        st: the store's storage; ``url``: the store's URL, as its user gave it.
        step: the step about to be saved.
        rank: this rank.

    Raises:
        CheckpointError: ``step`` is already committed.
    """
    d = step_dir(step)
    if st.exists(f"{d}/manifest.json"):
        raise CheckpointError(f"checkpoint step {step} is already committed under {url}; "
                              "save under a new step number")
    if rank == 0:
        if st.list_dir(d):
            log.info("ckpt_clear_leftover", step=step)
            st.delete_prefix(d)
        # before any rank writes (the agreement's barrier is next): the commit finds it still
        # there, or the step was deleted under the save (``commit._check_present``)
        st.write(f"{d}/{BEGIN_MARKER}", [b"{}"])
        newer = next((s for s in reversed(all_step_dirs(st)) if s > step
                      and st.exists(f"{step_dir(s)}/manifest.json")), None)
        if newer is not None:
            log.warning("ckpt_save_below_newest", step=step, newest=newer,
                        hint="load() with no step picks the newest committed step while it exists; "
                             "retention keeps it and this run's latest; delete the newer steps "
                             "if this run replaces them")


def _integer(value: Any, error: str) -> int:
    """``value`` as a plain int (any integer type, not a bool), or TypeError(``error``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(error)


def step_number(step: Any) -> int:
    """``step`` as a plain int in the range a step directory can name, or a one-line error."""
    n = _integer(step, f"checkpoint step must be an integer, not {type(step).__name__} {step!r}")
    if not 0 <= n <= MAX_STEP:
        raise ValueError(f"checkpoint step {n} is out of range: use 0 to {MAX_STEP}")
    return n


def retention_count(name: str, value: Any, minimum: int) -> int | None:
    """``value`` (a retention count, or None) as a plain int of at least ``minimum``, or a
    one-line TypeError / ValueError naming ``name``."""
    if value is None:
        return None
    n = _integer(value, f"{name}={value!r}: use an integer >= {minimum} or None")
    if n < minimum:
        raise ValueError(f"{name}={n}: use an integer >= {minimum} or None")
    return n


def prepare_step_dir_within(st: Storage, url: str, step: int, rank: int,
                            timeout_s: float) -> tuple[threading.Thread | None, BaseException | None]:
    """``prepare_step_dir``, waited on for at most ``timeout_s`` (a silent storage must not stall a step).

    Past the timeout the storage calls go on in a daemon thread until the storage answers;
    the caller does not save this step (every rank agrees first: ``agreement.agree_layout``)
    and must let that thread end before it prepares any step again (it may still clear and
    mark the step directory).

    Returns:
        ``(None, None)``: prepared in time; ``(None, exc)``: ``prepare_step_dir`` raised ``exc``
        in time; ``(thread, None)``: still waiting on the storage in ``thread``.
    """
    outcome: list[BaseException | None] = []

    def work() -> None:
        try:
            prepare_step_dir(st, url, step, rank)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append(exc)
    thread = threading.Thread(target=work, name="ckpt-prepare", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return thread, None
    return None, outcome[0]


def prepare_step(st: Storage, url: str, step: int, rank: int, bound: float | None,
                 stale: threading.Thread | None) -> tuple[threading.Thread | None, BaseException | None]:
    """A save's ``prepare_step_dir`` in the caller's thread, never raising: the ranks agree on
    every rank's readiness next (``agreement.agree_layout``), so that one rank's failure (a full
    disk refusing the begin marker, a storage error) fails the save on every rank alike.

    Args:
        st, url, step, rank: as ``prepare_step_dir``.
        bound: wait at most this long (``prepare_step_dir_within``), None: as long as it takes.
        stale: an earlier bounded prepare still waiting on the storage, or None. A bounded
            prepare is not tried while it waits; an unbounded one waits for it first.

    Returns:
        ``(thread, error)``: ``thread``, a prepare still waiting on the storage (not ready), or None;
        ``error``, what the prepare raised, or None.
    """
    if bound is not None:
        if stale is not None and stale.is_alive():
            return stale, None
        return prepare_step_dir_within(st, url, step, rank, bound)
    if stale is not None:
        stale.join()      # a timed-out prepare ends before this one clears or marks any step
    try:
        prepare_step_dir(st, url, step, rank)
    except Exception as exc:  # noqa: BLE001 - handed to the agreement, then raised on every rank
        return None, exc
    return None, None

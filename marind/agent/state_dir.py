"""The agent's state dir filling up: what it means and what to do, as pure functions.

The state dir (``--state-dir``) holds every run dir: torchrun's output, the workers' progress
records and rank 0's history, the curves, ``lease.json``, ``pids.json``. It counts as **full**
once a write into it failed with ENOSPC or EDQUOT (any writer that tells the agent: its own
files, torchrun's output relay) or a look at it (``statvfs``) finds less than
``FULL_FREE_BYTES`` free or no inode left. It counts as **back** once a look finds at least
:func:`resume_floor` bytes free (1 % of the filesystem, at least 2 MiB and at most 256 MiB:
room for more than a burst of output, so a volume that hovers at the edge does not flap) and a
probe write into it goes through (a quota that ``statvfs`` does not show); probes come at most
every ``PROBE_EVERY_S`` while full.

:func:`decide` folds one observation (:class:`WriteFailed`, :class:`Look`) into the state and
says whether it changed (:class:`Change`: the agent announces a change once, an event on each
of its jobs, never a log line per tick); :func:`admit` says whether a job may start here
(not while full: its run dir could not even hold its ``run.toml``); :func:`condition` is what
the node's record carries while full (``marind status``, ``marind doctor``). The I/O is the
agent's (``state_dir_watch``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from marind.core.disk import Space

#: less free space than this (bytes) counts as full
FULL_FREE_BYTES = 1 << 20
#: the floor of :func:`resume_floor`, and its cap
RESUME_MIN_BYTES = 2 << 20
RESUME_MAX_BYTES = 256 << 20
#: seconds between two probe writes while the state dir is full
PROBE_EVERY_S = 2.0

#: what a full state dir costs, in the words the event, the log and ``status`` use
EFFECT = ("running jobs go on; their output (logs/torchrun.log), rank 0's history and curves are "
          "dropped until space comes back; no new job starts on this node")
FIX = "free space on that filesystem (old run dirs under jobs/, logs), or give the agent a larger --state-dir"


class Change(str, Enum):
    """What an observation changed."""

    NONE = "none"
    FULL = "full"              # the state dir just became full
    RECOVERED = "recovered"    # space just came back


@dataclass(frozen=True)
class DirState:
    """What the agent knows of its state dir's space."""

    full: bool = False
    since: float | None = None           # when it became full
    error: str = ""                      # why it counts as full ("ENOSPC: No space left on device", ...)
    where: str = ""                      # the write (or look) that found it full
    free_bytes: int | None = None        # at the last look
    probed_at: float = 0.0               # the last probe write (while full)
    dropped: tuple[str, ...] = ()        # what could not be written meanwhile ("torchrun output", ...)


@dataclass(frozen=True)
class WriteFailed:
    """A write into the state dir failed with ENOSPC or EDQUOT."""

    what: str        # "torchrun output", "lease.json", ...
    path: str
    error: str       # ``marind.core.disk.error_text``


@dataclass(frozen=True)
class Look:
    """One look at the state dir's filesystem; ``probe_ok`` the probe write's outcome (None: none made)."""

    space: Space | None                  # None: ``statvfs`` failed
    probe_ok: bool | None = None


@dataclass(frozen=True)
class Verdict:
    """The new state, what changed, and why in words (empty without a change)."""

    state: DirState
    change: Change
    reason: str = ""


def resume_floor(total_bytes: int) -> int:
    """The free bytes that count as space back: 1 % of the filesystem, within [2 MiB, 256 MiB]."""
    return max(RESUME_MIN_BYTES, min(RESUME_MAX_BYTES, total_bytes // 100))


def _room(space: Space) -> bool:
    return space.free_bytes >= resume_floor(space.total_bytes) and space.free_inodes != 0


def decide(state: DirState, seen: WriteFailed | Look, now: float) -> Verdict:
    """Fold one observation into the state.

    Args:
        state: what the agent knew.
        seen: a failed write, or a look (with a probe write's outcome when one was made).
        now: the current time.

    Returns:
        The verdict: ``FULL`` the first time the state dir counts as full, ``RECOVERED`` when
        space is back, ``NONE`` otherwise (a second failed write while full only adds to ``dropped``).
    """
    if isinstance(seen, WriteFailed):
        dropped = state.dropped if seen.what in state.dropped else (*state.dropped, seen.what)
        if state.full:
            return Verdict(replace(state, dropped=dropped), Change.NONE)
        new = replace(state, full=True, since=now, error=seen.error, where=seen.path, probed_at=now,
                      dropped=dropped)
        return Verdict(new, Change.FULL, f"writing {seen.what} ({seen.path}) failed: {seen.error}")
    space = seen.space
    if space is None:
        return Verdict(state, Change.NONE)
    probed = now if seen.probe_ok is not None else state.probed_at
    if not state.full:
        if space.free_bytes < FULL_FREE_BYTES or space.free_inodes == 0:
            why = "no free inode left" if space.free_inodes == 0 else f"under {_size(FULL_FREE_BYTES)} free"
            new = replace(state, full=True, since=now, error=why, where="statvfs", free_bytes=space.free_bytes,
                          probed_at=now)
            return Verdict(new, Change.FULL, why)
        return Verdict(replace(state, free_bytes=space.free_bytes), Change.NONE)
    if _room(space) and seen.probe_ok:
        return Verdict(DirState(free_bytes=space.free_bytes), Change.RECOVERED,
                       f"{space.free_bytes} bytes free and a write went through")
    return Verdict(replace(state, free_bytes=space.free_bytes, probed_at=probed), Change.NONE)


def probe_due(state: DirState, space: Space | None, now: float) -> bool:
    """Should this look include a probe write? Only while full, with room seen, at most every ``PROBE_EVERY_S``."""
    return state.full and space is not None and _room(space) and now - state.probed_at >= PROBE_EVERY_S


def admit(state: DirState, path: str) -> tuple[bool, str]:
    """May a job start on this node, as far as the state dir goes?

    A full state dir refuses it (the job stays PENDING for the other nodes, and starts here once
    space is back): its run dir could not hold its ``run.toml`` nor its output, and an operator
    expects a node short of disk to take no new work while it keeps what runs.

    Returns:
        (start, why not).
    """
    if not state.full:
        return True, ""
    return False, f"not started on this node: {describe(state, path)}"


def describe(state: DirState, path: str) -> str:
    """The state dir's condition in one line (empty while it is not full)."""
    if not state.full:
        return ""
    free = "" if state.free_bytes is None else f": {_size(state.free_bytes)} free"
    return f"state dir {path} is full{free} ({state.error}); fix: {FIX}"


def condition(state: DirState, path: str) -> dict | None:
    """The node record's ``state_dir_full`` while full (None otherwise): ``{path, since, error, free_bytes, reason}``."""
    if not state.full:
        return None
    return {"path": path, "since": state.since, "error": state.error, "free_bytes": state.free_bytes,
            "reason": describe(state, path)}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

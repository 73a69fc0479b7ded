"""Typed errors of the checkpoint store (all CheckpointError; a CLI maps them to exit code 1).

And why a save failed, in words a user can act on (``failure_kind``, ``failure_reason``: pure
functions of the error's text, since a save's error travels as text, from the writer process
and from other ranks): ``disk_full`` (ENOSPC, EDQUOT: the checkpoint volume is full),
``storage_throttled`` (S3 SlowDown / 5xx past the retry budget), ``storage_unavailable``
(connection refused or reset, a timeout) or ``other``.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every checkpoint-store error; ``exit_code``: what a command line exits with."""

    exit_code = 1


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint (or not the requested step) under the store URL."""


class CheckpointCorrupt(CheckpointError):
    """An object of a committed checkpoint is missing, truncated or fails its checksum."""

    def __init__(self, obj: str, reason: str):
        super().__init__(f"checkpoint object {obj!r} is corrupt: {reason}")
        self.object = obj
        self.reason = reason


class CheckpointMismatch(CheckpointError):
    """The target state does not match the checkpoint; `problems` lists every bad key."""

    def __init__(self, step: int, problems: list[str]):
        listed = "; ".join(problems)
        super().__init__(f"state does not match checkpoint step {step} ({len(problems)} keys): {listed}")
        self.step = step
        self.problems = list(problems)


class CheckpointSaveFailed(CheckpointError):
    """A save did not commit; its step stays invisible to readers."""


class CheckpointFormatUnsupported(CheckpointError):
    """A step was written in a checkpoint format this marind does not read (a newer marind's)."""


class CheckpointStorageUnavailable(CheckpointError):
    """The store's storage cannot be reached, or refuses the credentials (names the fix)."""


DISK_FULL = "disk_full"
STORAGE_THROTTLED = "storage_throttled"
STORAGE_UNAVAILABLE = "storage_unavailable"
OTHER = "other"

_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (DISK_FULL, ("no space left on device", "errno 28", "disk quota exceeded", "errno 122")),
    (STORAGE_THROTTLED, ("slowdown", "slow down", "reduce your request rate", "(503)", "(500)", "(502)",
                         "(504)", "serviceunavailable", "service unavailable", "internalerror",
                         "max retries", "retry quota")),
    (STORAGE_UNAVAILABLE, ("connection refused", "connection reset", "could not connect", "timed out",
                           "timeout", "storage did not answer", "endpoint")),
)

_FIXES = {
    DISK_FULL: "the checkpoint volume is full: free space on it, or keep fewer checkpoints "
               "([checkpoint] keep_last / keep_every); training goes on and the next save that fits commits",
    STORAGE_THROTTLED: "the object store pushed back (SlowDown / 5xx) past the retry budget; training goes on "
                       "and the next save tries again",
    STORAGE_UNAVAILABLE: "the checkpoint storage did not answer; training goes on and the next save tries again",
}


def failure_kind(error: str) -> str:
    """The kind of a save's error text: ``DISK_FULL``, ``STORAGE_THROTTLED``, ``STORAGE_UNAVAILABLE``
    or ``OTHER`` (the first kind whose pattern the text holds, case-insensitive)."""
    low = error.lower()
    for kind, patterns in _PATTERNS:
        if any(p in low for p in patterns):
            return kind
    return OTHER


def failure_reason(step: int, error: str, url: str | None = None) -> tuple[str, str]:
    """``(kind, reason)`` for a save of ``step`` that failed with ``error``.

    Args:
        step: the step that did not commit.
        error: the error text (on whichever rank it happened).
        url: the store's URL, named in the reason when given.

    Returns:
        The kind (``failure_kind``) and one line: what failed, where, why, and the fix.
    """
    kind = failure_kind(error)
    where = f" under {url}" if url else ""
    fix = _FIXES.get(kind)
    line = f"checkpoint step {step}{where} did not commit: {error}"
    return kind, f"{line} ({fix})" if fix else line

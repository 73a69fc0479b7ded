"""Typed errors of the checkpoint store (all CheckpointError; a CLI maps them to exit code 1)."""

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

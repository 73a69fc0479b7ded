"""PendingSave: the handle of one save, shared by the caller, its snapshot copy and its writer.

Two events: the save is *done* (committed or failed; the writer says so with
``finish``), and its snapshot *copy* is over (the arena may be reused and the
state changed again; only the thread that copies says so). An error nobody
has seen yet (``observed`` is False) is reported once: by ``wait()``, the
next ``save()`` or ``close()``. Torch-free: the writers use it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ckpt_store.errors import CheckpointSaveFailed


class PendingSave:
    """Handle of a save; ``wait()`` returns once committed, raises if it failed.

    Attributes:
        step: the step being saved.
        timings: seconds per phase (``prepare_s``, ``blocked_s``, ``write_s``, ``commit_s``,
            ``step_wait_s``), filled in as the save goes.
        finished_at: ``time.perf_counter()`` when it committed or failed (None before).
        observed: its outcome has been reported to the caller.
        cuda_ready: the CUDA event an async copy's own stream waits for (None without CUDA).
    """

    def __init__(self, step: int):
        self.step = step
        self._done = threading.Event()
        self._copied = threading.Event()   # the snapshot is taken: the state may change again
        self._copied.set()
        self._error: BaseException | None = None
        self.observed = False
        self.timings: dict[str, float] = {}
        self.finished_at: float | None = None
        self.cuda_ready: Any = None

    # -- the writer ------------------------------------------------------------------------
    def finish(self, error: BaseException | None, timings: dict | None = None) -> None:
        """The writer is done with this save: committed (``error`` None) or failed. Only the
        first call counts. (The copy is tracked apart: only the thread that copies ends it,
        so nothing reuses the arena while that thread still writes it.)"""
        if self._done.is_set():
            return
        self.timings.update(timings or {})
        self.finished_at = time.perf_counter()
        self._error = error
        self._done.set()

    # -- the caller ------------------------------------------------------------------------
    def done(self) -> bool:
        """Has the save committed or failed?"""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save committed.

        Args:
            timeout: seconds to wait at most (None: as long as it takes; the store's
                ``commit_timeout_s`` bounds a save anyway).

        Raises:
            TimeoutError: not done within ``timeout``.
            CheckpointSaveFailed: the save did not commit (its cause chained).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} not committed within {timeout}s")
        self.observed = True
        if self._error is not None:
            raise CheckpointSaveFailed(f"checkpoint step {self.step} did not commit: "
                                       f"{self._error}") from self._error

    # -- the store -------------------------------------------------------------------------
    def copy_started(self) -> None:
        """An async copy of the snapshot begins (on a thread of its own)."""
        self._copied.clear()

    def copy_finished(self) -> None:
        """The snapshot copy is over (made, or failed): the arena and the state are free."""
        self._copied.set()

    def wait_copied(self, count_as: str | None = None) -> None:
        """Wait until the snapshot copy is over; ``count_as``: add the time waited, if any,
        to that timing."""
        if self._copied.is_set():
            return
        t0 = time.perf_counter()
        self._copied.wait()
        if count_as:
            self.timings[count_as] = self.timings.get(count_as, 0.0) + time.perf_counter() - t0

    def settle(self) -> None:
        """Wait until the save is done and its copy is over."""
        self._done.wait()
        self._copied.wait()

    def mark_observed(self) -> None:
        """The caller has seen this save's outcome (raised to it another way)."""
        self.observed = True

    def failed(self) -> bool:
        """Is the save done, and did it fail? (Does not count as seeing its outcome.)"""
        return self._done.is_set() and self._error is not None

    def error_text(self) -> str | None:
        """The failed save's error in words, None while running or when it committed."""
        return f"{self._error}" if self.failed() else None

    def unreported_error(self) -> BaseException | None:
        """The save's error if nobody has seen it yet (and from now on it counts as seen)."""
        if self._error is None or self.observed:
            return None
        self.observed = True
        return self._error

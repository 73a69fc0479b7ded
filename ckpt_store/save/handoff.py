"""The handoff of a snapshot from the saving caller to its writer, while the copy is made.

The caller submits a save's job before it copies anything, then copies the
slots in order and says how far it got. The writer writes slot ``i`` as soon
as the first ``i + 1`` slots are copied, so the copy and the writes overlap
(a sync save waits for both, not one after the other), and it reports its
part done only once the whole copy is ``complete``: the caller checks after
the copy that no tensor changed under it, and a copy that fails there fails
the save instead of committing a torn checkpoint.

No torch here: the writer process uses this too, fed by messages on its pipe.
"""

from __future__ import annotations

import threading

from ckpt_store.errors import CheckpointSaveFailed


class SnapshotHandoff:
    def __init__(self):
        self._cv = threading.Condition()
        self.copied = 0
        self.complete = False
        self.error: str | None = None
        self.cancelled = False

    def advance(self, copied: int, complete: bool = False) -> None:
        """The first ``copied`` slots hold their data; ``complete``: the copy is whole and sound."""
        with self._cv:
            self.copied = max(self.copied, copied)
            self.complete = self.complete or complete
            self._cv.notify_all()

    def fail(self, error: str) -> None:
        with self._cv:
            self.error = error
            self._cv.notify_all()

    def cancel(self, error: str) -> None:
        """The ranks agreed the save failed (``CheckpointStore.settle``): stop, failing with ``error``."""
        with self._cv:
            self.error, self.cancelled = error, True
            self._cv.notify_all()

    def wait_slot(self, index: int, timeout_s: float) -> None:
        self._wait(lambda: self.copied > index, timeout_s, f"slot {index}")

    def wait_complete(self, timeout_s: float) -> None:
        self._wait(lambda: self.complete, timeout_s, "the whole snapshot")

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: ready() or self.error is not None, timeout_s):
                raise CheckpointSaveFailed(f"the snapshot copy did not reach {what} within {timeout_s}s")
            if self.error is not None:
                raise CheckpointSaveFailed(self.error if self.cancelled else f"the snapshot copy failed: {self.error}")

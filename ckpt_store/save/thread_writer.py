"""The in-process writer: a save's background part on a thread (``writer="thread"``).

``ThreadWriter`` runs ``rank_part.run_save`` for each ``SaveJob``, one at a
time, in order, over the snapshot arena, and finishes the job's
``PendingSave`` once it committed (and, on rank 0, retention ran) or failed.
It serves ``memory://`` stores (their objects live in this process) and
storage options that are not JSON; everything else gets a writer process
(``writer_client.py``), which keeps the encoding and uploads off this
process's GIL.
"""

from __future__ import annotations

import queue
import threading

from ckpt_store.log import get_logger
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.pending import PendingSave
from ckpt_store.save.rank_part import run_save
from ckpt_store.save.save_job import SaveJob
from ckpt_store.save.snapshot import HostArena
from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)
CLOSE_TIMEOUT_S = 30.0


class ThreadWriter:
    """A ``SaveWriter`` on one thread of this process, over the snapshot arena."""

    def __init__(self, storage: Storage, arena: HostArena):
        self._st, self._arena = storage, arena
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._handoff: SnapshotHandoff | None = None    # the latest job's
        self._step: int | None = None                   # the latest job's step
        self.pid: int | None = None

    def submit(self, job: SaveJob, pending: PendingSave) -> None:
        """Queue ``job`` (the thread starts with the first one)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
            self._thread.start()
        self._handoff, self._step = SnapshotHandoff(), job.step
        self._jobs.put((job, pending, self._handoff))

    def copied(self, slots: int, complete: bool = False) -> None:
        """The latest job's first ``slots`` slots are copied; ``complete``: the whole copy is sound."""
        if self._handoff is not None:
            self._handoff.advance(slots, complete)

    def copy_failed(self, error: str) -> None:
        """The latest job's copy failed: its part fails."""
        if self._handoff is not None:
            self._handoff.fail(error)

    def cancel(self, step: int, error: str) -> None:
        """The ranks agreed the save of ``step`` failed: the latest job stops, failed."""
        if self._handoff is not None and self._step == step:
            self._handoff.cancel(error)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, pending, handoff = item
            try:
                run_save(self._st, job, self._arena.view(), lambda t, pending=pending: pending.finish(None, t),
                         handoff)
            except BaseException as exc:  # noqa: BLE001 - surfaced at wait()/next save()
                log.warning("ckpt_save_failed", step=job.step, rank=job.rank, error=str(exc))
                if not pending.done():
                    pending.finish(exc)

    def close(self) -> None:
        """Finish the queued jobs (waiting at most ``CLOSE_TIMEOUT_S``) and stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(CLOSE_TIMEOUT_S)
            self._thread = None

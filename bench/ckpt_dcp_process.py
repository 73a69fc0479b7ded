"""DCP's best async mode for the checkpoint benchmark: ``async_save`` in its checkpoint process.

torch 2.13's ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS,
async_stager=DefaultStager(StagingOptions(...)))``: the state is staged (copied) into
shared memory (pinned too where CUDA is there) by a staging thread, and a daemon
process per rank, started by the first such save with its own process group,
writes it. The stager is kept across saves (its staging buffers are reused) and
closed at the end (``close``). The training loop may run forward and backward
while the staging copy runs, but its optimizer step must wait for it: that wait
is counted as blocked time, as marind's ``step_wait_s`` is.
"""

from __future__ import annotations

import time
from typing import Any


class DcpProcessSaver:
    """One rank's process-based DCP async saver (one stager reused across saves)."""

    def __init__(self) -> None:
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))

    def save(self, state: dict, checkpoint_id: Any, storage_writer: Any, group: Any, optim: Any):
        """Start an async save; returns ``(upload_future, staging_wait)`` where
        ``staging_wait()`` is the seconds the optimizer's next step waited for the copy."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        resp = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                              process_group=group, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self.stager)
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        waited = [0.0]
        handle: list = []

        def before_step(*_args) -> None:
            if staging is not None and not staging.done():
                t0 = time.perf_counter()
                staging.result()
                waited[0] += time.perf_counter() - t0
            handle.pop().remove()

        handle.append(optim.register_step_pre_hook(before_step))

        def staging_wait() -> float:
            if handle:              # no step ran during the save: the copy was waited for here
                handle.pop().remove()
                if staging is not None:
                    t0 = time.perf_counter()
                    staging.result()
                    waited[0] += time.perf_counter() - t0
            return waited[0]
        return upload, staging_wait

    def close(self) -> None:
        """Free the staging buffers."""
        self.stager.close()

"""Rank targets for the S3-storm tests (run via ``procs.run_torch_workers``): a training-like loop
that saves every few steps through a store whose S3 pushes back (``marind.testing.s3_faults``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt_store import CheckpointSaveFailed, CheckpointStore, all_ranks_ok


def save_through_storm(url: str, storage_options: dict, every: int, step_s: float, give_up_s: float,
                       started_file: str, stop_file: str, max_steps: int = 2000) -> dict:
    """Step (``step_s`` each) until ``stop_file`` exists (the ranks agree on it each step: one
    all-reduce), saving every ``every`` steps as the trainer does (settle the previous save with
    every rank, waiting at most ``give_up_s``, then an async save), then a final sync save. Rank 0
    writes ``started_file`` once a save committed. Returns each step's outcome on this rank
    (``committed``, ``failed``, ``skipped``, ``refused``) and the steps run."""
    rank = dist.get_rank()      # worker_main joined the gloo group
    store = CheckpointStore(url, storage_options=storage_options, prepare_timeout_s=give_up_s)
    w = torch.zeros(512, 1024)     # 2 MiB per rank's state
    outcomes: dict[int, str] = {}
    ran = 0

    def observe(step: int | None, agreed: str | None) -> None:
        if step is None or step in outcomes:
            return
        outcomes[step] = "failed" if agreed else "committed"
        try:
            store.wait()          # seen: the next save does not raise it again
        except CheckpointSaveFailed:
            pass

    def save(step: int, async_: bool) -> None:
        prev = store.pending_step
        agreed = store.settle(None, None if not async_ else give_up_s)
        if agreed == "busy":
            outcomes[step] = "skipped"
            return
        observe(prev, agreed)
        try:
            store.save(step, {"w": w, "extra": {"step": step, "rank": rank}}, async_=async_)
        except CheckpointSaveFailed:
            outcomes[step] = "refused"
            return
        if not async_:
            outcomes[step] = "committed"

    for step in range(1, max_steps + 1):
        w += 1
        time.sleep(step_s)
        ran = step
        if step % every == 0:
            save(step, async_=True)
        if rank == 0 and "committed" in outcomes.values() and not Path(started_file).exists():
            Path(started_file).write_text(str(step))
        if not all_ranks_ok(not Path(stop_file).exists()):
            break
    observe(store.pending_step, store.settle())
    save(ran + 1, async_=False)
    store.close()
    return {"outcomes": {str(k): v for k, v in sorted(outcomes.items())}, "ran": ran}

"""Functions run on real gloo ranks by ``run_torch_workers`` in the worker API tests."""

from __future__ import annotations

import os
import signal

import marind.worker as mw


def stop_together(signal_rank: int, signal_at: int, steps: int) -> dict:
    """Step until ``should_stop``; rank ``signal_rank`` sends itself SIGTERM after step ``signal_at``."""
    import torch.distributed as dist

    mw.install()
    rank = dist.get_rank()
    step = 0
    while step < steps:
        step += 1
        if rank == signal_rank and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if mw.should_stop():
            break
    return {"rank": rank, "stopped_at": step, "again": mw.should_stop()}


def collective_timeout_text(timeout_s: float, silent_rank: int) -> dict:
    """Rank ``silent_rank`` stops answering; the others' gloo all-reduce times out: their error's text."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_rank() == silent_rank:
        time.sleep(timeout_s + 2)          # past rank 0's timeout, then gone
        return {"rank": silent_rank, "error": None}
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as exc:
        return {"rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": dist.get_rank(), "error": None}

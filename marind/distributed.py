"""Process-group setup shared by the trainer, benchmarks and tests.

The backend follows the device: nccl when CUDA is available (one GPU per
local rank), gloo otherwise. Shutdown is always barrier + destroy, the
one way a worker ends (gloo ranks that exit without it sometimes abort).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def device_for_local_rank() -> torch.device:
    """This rank's device: CUDA device ``LOCAL_RANK`` (modulo the count, and made current) or the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The process-group backend for ``device``: nccl on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Join the process group described by torchrun's environment (once; later calls only return the device).

    Args:
        timeout_s: timeout of the group's collectives, in seconds.

    Returns:
        This rank's device.

    Raises:
        ValueError: torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) are missing.
        torch.distributed.DistStoreError: the rendezvous store did not answer in time.
    """
    device = device_for_local_rank()
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend_for(device),
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return device


def shutdown_distributed() -> None:
    """Barrier, then destroy the process group (nothing when there is none)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()

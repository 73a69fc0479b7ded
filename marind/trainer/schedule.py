"""Learning-rate schedule (a pure function of the step) and MFU arithmetic."""

from __future__ import annotations

import math
import os

import torch

from marind.core import workerenv


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` at ``total_steps``.

    ``step`` is the 0-based index of the optimizer step about to run.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


_GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                  "L4": 121e12, "V100": 125e12}


def peak_flops_per_device(device: torch.device, local_world_size: int = 1) -> float:
    """Peak dense FLOP/s of one rank's device: ``MARIND_PEAK_FLOPS`` if set, else a table/estimate.

    CPU: an AVX2-FMA estimate (32 fp32 FLOP/cycle/core at 2.5 GHz) over the cores this
    rank gets (usable cores / local ranks). Only a reference point for MFU.
    """
    env = os.environ.get(workerenv.PEAK_FLOPS)
    if env:
        return float(env)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_BF16.items():
            if key in name:
                return value
        return 312e12
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 32 * 2.5e9 * max(1.0, cores / max(1, local_world_size))

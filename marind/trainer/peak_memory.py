"""This rank's peak memory, for the final progress record's ``metrics`` (one read, off the step path).

* ``peak_rss_bytes``: the process's resident-set high-water mark, ``VmHWM`` of
  ``/proc/self/status`` (Linux). Not ``getrusage``'s ``ru_maxrss``: after ``exec`` Linux keeps
  the larger of the old and the new image's peak there, and a worker that torchrun (or any
  process holding torch) starts through ``vfork``/``exec`` would report its parent's peak.
  ``ru_maxrss`` is the fallback where there is no ``/proc``.
* ``peak_cuda_allocated_bytes`` / ``peak_cuda_reserved_bytes``: the caching allocator's high-water
  marks (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) when the device is CUDA.
* ``peak_memory_bytes``: the figure a benchmark compares, the device's: CUDA allocated on a GPU,
  the RSS high-water mark on CPU.

``setup_peak_memory_bytes`` is the same figure read before the first step (model built and
materialized, no optimizer state yet): with meta-device construction it is about the rank's own
shards, not the whole model.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def parse_vm_hwm(status: str) -> int | None:
    """The ``VmHWM`` line of a ``/proc/<pid>/status`` text, in bytes (pure).

    Args:
        status: the file's text.

    Returns:
        Bytes, or None when the text has no (well-formed) ``VmHWM`` line.
    """
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                unit = parts[2].lower() if len(parts) > 2 else "kb"
                return int(parts[1]) * (1024 if unit == "kb" else 1)
    return None


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark in bytes (``VmHWM``; ``ru_maxrss`` without ``/proc``)."""
    try:
        hwm = parse_vm_hwm(_STATUS.read_text())
    except OSError:
        hwm = None
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024   # bytes on macOS, KiB elsewhere


def peak_memory(device: torch.device) -> dict[str, float]:
    """This rank's peak memory so far, as progress-record metrics (see the module docstring).

    Args:
        device: the rank's device.

    Returns:
        ``peak_memory_bytes``, ``peak_rss_bytes`` and, on CUDA, ``peak_cuda_allocated_bytes`` and
        ``peak_cuda_reserved_bytes``.
    """
    rss = float(peak_rss_bytes())
    out = {"peak_memory_bytes": rss, "peak_rss_bytes": rss}
    if device.type == "cuda":
        allocated = float(torch.cuda.max_memory_allocated(device))
        out.update(peak_memory_bytes=allocated, peak_cuda_allocated_bytes=allocated,
                   peak_cuda_reserved_bytes=float(torch.cuda.max_memory_reserved(device)))
    return out

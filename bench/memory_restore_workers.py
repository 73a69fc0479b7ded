"""Rank targets of bench/memory_restore_bench.py (run via procs.run_torch_workers): each rank plays
``hosts[rank]``; the state is ``mb`` MB of float32 arrays sharded along dim 0 (FSDP-like)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckpt_store import CheckpointStore, MemoryTier

ARRAYS = 8


def _state(mb: int, zeros: bool) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = max(1, mb * (1 << 20) // (4 * ARRAYS * 1024))
    out = {}
    for i in range(ARRAYS):
        g = torch.Generator().manual_seed(i)
        full = torch.zeros(rows, 1024) if zeros else torch.randn(rows, 1024, generator=g)
        out[f"w{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    return {"model": out, "extra": {"step": 1}}


def save_all(mb: int, base: str, run: str, hosts: list[str], urls: list[str], s3_opts: dict | None) -> dict:
    """Save one step into the memory tier and into each durable ``url``."""
    state = _state(mb, zeros=False)
    tier = MemoryTier.open(run, base=base, host=hosts[dist.get_rank()], keep_last=1)
    t0 = time.perf_counter()
    tier.store.save(1, state, async_=False)
    out = {"memory_save_s": time.perf_counter() - t0}
    tier.close()
    for url in urls:
        store = CheckpointStore(url, s3_opts if url.startswith("s3://") else None)
        t0 = time.perf_counter()
        store.save(1, state, async_=False)
        out[f"save_s:{url.split(':')[0]}"] = time.perf_counter() - t0
        store.close()
    return out


def load_one(mb: int, source: str, base: str, run: str, hosts: list[str], url: str, s3_opts: dict | None) -> dict:
    """Load step 1 from ``source`` ("memory" or a durable ``url``) into this world; the seconds
    from the call to every rank's return (a barrier after), and whether the values are right."""
    state = _state(mb, zeros=True)
    tier = None
    if source == "memory":
        tier = MemoryTier.open(run, base=base, host=hosts[dist.get_rank()], keep_last=1)
        store = tier.store
    else:
        store = CheckpointStore(url, s3_opts if url.startswith("s3://") else None)
    dist.barrier()
    t0 = time.perf_counter()
    store.load(state, step=1)
    dist.barrier()
    seconds = time.perf_counter() - t0
    ok = bool(torch.equal(state["model"]["w0"].full_tensor()[:4],
                          torch.randn(state["model"]["w0"].shape, generator=torch.Generator().manual_seed(0))[:4]))
    if tier is not None:
        tier.close()
    else:
        store.close()
    return {"load_s": seconds, "ok": ok}

"""Tiny targets for exercising ``run_torch_workers`` itself."""

import torch
import torch.distributed as dist


def allreduce_rank() -> dict:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item()}


def fail_on_rank(rank: int) -> dict:
    if dist.get_rank() == rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return {}


def sleep_forever() -> dict:
    import time
    time.sleep(3600)
    return {}

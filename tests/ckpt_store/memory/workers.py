"""Rank targets of the memory-tier tests (run via procs.run_torch_workers): each rank plays
the host ``hosts[rank]``; a host's memory is its directory under ``base`` (a test "powers a host
off" by deleting its directory before the next world starts)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckpt_store import CheckpointSaveFailed, CheckpointStore, MemoryTier

SHAPES = {"model/w": (12, 5), "model/b": (7,), "optim/w/exp_avg": (12, 5), "optim/w/exp_avg_sq": (12, 5)}


def expected(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def make_state(step: int, zeros: bool = False) -> dict:
    """The state of ``step``, sharded over the current world (FSDP-like: dim 0)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state: dict = {"model": {}, "optim": {"w": {}}}
    for name in SHAPES:
        full = torch.zeros(SHAPES[name]) if zeros else expected(name, step)
        t = distribute_tensor(full, mesh, [Shard(0)])
        parts = name.split("/")
        node = state
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = t
    state["extra"] = {"step": 0 if zeros else step, "data_position": 0 if zeros else 64 * step,
                      "rng": {} if zeros else {f"rank-{dist.get_rank()}": f"rng-{step}-{dist.get_rank()}"}}
    return state


def equal_to_step(state: dict, step: int) -> bool:
    """Every tensor of ``state`` equals ``step``'s, bit for bit, and so do its values."""
    for name in SHAPES:
        node = state
        for p in name.split("/"):
            node = node[p]
        full = node.full_tensor() if isinstance(node, DTensor) else node
        if not torch.equal(full, expected(name, step)):
            return False
    return state["extra"]["step"] == step and state["extra"]["data_position"] == 64 * step


def save_steps(base: str, run: str, hosts: list[str], steps: list[int], durable: str = "",
               durable_steps: tuple = (), stop_server_of: str = "", stop_before: int = -1) -> dict:
    """Save ``steps`` into the memory tier (and ``durable_steps`` into ``durable``); before step
    ``stop_before`` the host ``stop_server_of`` stops its transfer server (its replicas cannot land)."""
    host = hosts[dist.get_rank()]
    tier = MemoryTier.open(run, base=base, host=host, keep_last=2, timeout_s=10.0, commit_timeout_s=30.0)
    store = CheckpointStore(durable) if durable else None
    out: dict = {}
    for step in steps:
        if step == stop_before and host == stop_server_of and tier._server is not None:
            from ckpt_store.memory.server import stop_server
            stop_server(tier._server)
        dist.barrier()
        state = make_state(step)
        try:
            tier.store.save(step, state).wait()
            out[str(step)] = "committed"
        except CheckpointSaveFailed as exc:
            out[str(step)] = f"failed: {exc}"
        if store is not None and step in durable_steps:
            store.save(step, state, async_=False)
    dist.barrier()
    if store is not None:
        store.close()
    try:
        tier.close()
    except CheckpointSaveFailed:
        pass
    return out


def restore(base: str, run: str, hosts: list[str], durable: str = "") -> dict:
    """A new world on ``hosts``: restore the newest memory step complete on the live hosts, else
    the durable store's newest; say which and whether the state is bit for bit that step's."""
    host = hosts[dist.get_rank()]
    tier = MemoryTier.open(run, base=base, host=host, keep_last=2, timeout_s=10.0)
    found = tier.agreed_restorable()
    complete = [m.step for m in found if m.complete]
    state = make_state(0, zeros=True)
    if complete:
        source, step = "memory", complete[0]
        tier.store.load(state, step=step)
    else:
        store = CheckpointStore(durable)
        step = store.latest() or -1
        source = "durable"
        store.load(state)
        store.close()
    rank = dist.get_rank()
    rng_ok = state["extra"]["rng"].get(f"rank-{rank}", f"rng-{step}-{rank}") == f"rng-{step}-{rank}"
    tier.close()
    return {"found": [[m.step, m.complete, m.reason] for m in found], "source": source, "step": step,
            "equal": equal_to_step(state, step) and rng_ok, "world": dist.get_world_size()}

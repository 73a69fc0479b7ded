"""Small sharded arrays are gathered whole before the snapshot and written as one object.

A norm weight or a bias sharded over N ranks is otherwise N objects of a few
hundred bytes to a few KB. On an object store each object costs a request,
and here a request costs far more than its bytes: on SeaweedFS about 1.3 ms of
server CPU and 2 ms of client CPU per PUT, while 4 KB take microseconds. One
all-gather of every such array (each region sent once, by the lowest rank
holding it) lets one rank write each whole, and the writers of different
arrays take turns, as replicas do. A rank that loads such an array into a
sharded layout reads the whole (small) object, which the size limit keeps
negligible next to the state.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ckpt_store import layout
from ckpt_store.plan import ArrayPlan, all_pieces, mesh_ranks
from ckpt_store.zarr_format import ArraySpec

#: arrays of at most this many bytes that a save would split into several objects
SMALL_ARRAY_BYTES = 256 << 10
#: at most this much in all is gathered per save (the rest is written as it is held)
GATHER_BUDGET_BYTES = 64 << 20


def small_sharded(plan: ArrayPlan, tensor: torch.Tensor, limit: int, world: int) -> bool:
    """Would ``plan`` write a small array as several objects, split along dim 0 only?
    (Those become inner chunks of one object: a rank that loads its old rows reads just them.)
    Only arrays on a mesh of the whole world (``save`` has checked that every rank holds
    the same arrays, so every rank picks the same ones; arrays on a sub-mesh are left as
    they are)."""
    spec = plan.spec
    grid = layout.grid_shape(spec.shape, spec.chunks)
    return (isinstance(tensor, DTensor) and len(grid) > 0 and grid[0] > 1 and math.prod(grid[1:]) == 1
            and math.prod(spec.shape) * spec.itemsize <= limit
            and len(mesh_ranks(tensor.device_mesh)[0]) == world)


def whole_spec(spec: ArraySpec, inner_bytes: int) -> ArraySpec:
    """One chunk for the whole array, its inner chunks (the sharding codec) no taller than
    the per-shard chunks it replaces; the chunk is padded to a whole number of them."""
    rows = layout.inner_rows(spec.chunks, spec.itemsize, inner_bytes)
    height = -(-spec.shape[0] // rows) * rows
    return ArraySpec(spec.name, spec.shape, spec.dtype, (height, *spec.shape[1:]),
                     rows if rows < height else None)


def gather_small(plans: list[ArrayPlan], tensors: dict[str, torch.Tensor], rank: int, world: int,
                 limit: int = SMALL_ARRAY_BYTES, inner_bytes: int = 1 << 20,
                 budget: int = GATHER_BUDGET_BYTES) -> list[ArrayPlan]:
    """Replace the plans of small sharded arrays by single-chunk plans written by one rank.

    A collective on the default group: every rank must call it with the same
    arrays (as every rank of a save does). ``plans[i]`` was made with salt ``i``.
    """
    if world <= 1 or limit <= 0:
        return plans
    picks, total = [], 0
    for i, plan in enumerate(plans):
        t = tensors[plan.spec.name]
        if small_sharded(plan, t, limit, world):
            nbytes = math.prod(plan.spec.shape) * plan.spec.itemsize
            if total + nbytes > budget:
                break
            picks.append(i)
            total += nbytes
    if not picks:
        return plans
    arrays = [(plans[i].spec.itemsize, all_pieces(tensors[plans[i].spec.name])) for i in picks]
    sizes, parts = layout.gather_plan(arrays)
    width = max(sizes)
    device = plans[picks[0]].local.device
    send = torch.zeros(width, dtype=torch.uint8, device=device)
    for i, array_parts in zip(picks, parts):
        plan = plans[i]
        for part in array_parts:
            if part.rank == rank:
                _region(send, part, plan.local.dtype).copy_(plan.local[part.piece.local_slices()])
    recv = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(recv, send)
    out = list(plans)
    for i, array_parts in zip(picks, parts):
        plan, t = plans[i], tensors[plans[i].spec.name]
        spec = plan.spec
        whole = whole_spec(spec, inner_bytes)
        everyone = layout.replicated_pieces(spec.shape, world)
        owned = tuple(layout.owned_cells(spec.shape, whole.chunks, everyone, rank, i))
        if owned:
            full = torch.empty(spec.shape, dtype=t.dtype, device=device)
            for part in array_parts:
                full[part.piece.box.slices()] = _region(recv[part.rank], part, t.dtype)
        else:
            full = plan.local   # this rank writes none of it: nothing to assemble
        out[i] = ArrayPlan(whole, tuple(everyone[rank]), full, owned, plan.layout)
    return out


def _region(buf: torch.Tensor, part: layout.GatherPart, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``part`` in a send/receive buffer, viewed as its region of the array."""
    shape = part.piece.box.shape
    n = math.prod(shape) * dtype.itemsize
    return buf[part.offset:part.offset + n].view(dtype).view(shape)

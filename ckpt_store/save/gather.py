"""Small sharded arrays are gathered whole before the snapshot and written as one object.

A norm weight or a bias sharded over N ranks is otherwise N objects of a few
hundred bytes to a few KB. On an object store each object costs a request,
and here a request costs far more than its bytes: a PUT's server and client CPU
does not shrink with its size, and is far more than a few KB take to send
(figures: docs/perf.md, "Checkpoints: S3"). One
all-gather of every such array (each region sent once, by the lowest rank
holding it) lets one rank write each whole, and the writers of different
arrays take turns, as replicas do. A rank that loads such an array into a
sharded layout reads the whole (small) object, which the size limit keeps
negligible next to the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from ckpt_store.format import layout
from ckpt_store.format.plan import ArrayPlan, static_pieces, static_where
from ckpt_store.format.zarr_format import ArraySpec

#: arrays of at most this many bytes that a save would split into several objects
SMALL_ARRAY_BYTES = 256 << 10
#: at most this much in all is gathered per save (the rest is written as it is held)
GATHER_BUDGET_BYTES = 64 << 20


def small_sharded(static: tuple, spec: ArraySpec, limit: int, world: int) -> bool:
    """Would the plan made from ``static`` (``ArrayPlan.static``) write a small array as several
    objects, split along dim 0 only? (Those become inner chunks of one object: a rank that
    loads its old rows reads just them.) Only DTensors on a mesh of the whole world (``save``
    has checked that every rank holds the same arrays, so every rank picks the same ones;
    arrays on a sub-mesh are left as they are)."""
    where = static_where(static)
    grid = layout.grid_shape(spec.shape, spec.chunks)
    return (where is not None and len(grid) > 0 and grid[0] > 1 and math.prod(grid[1:]) == 1
            and math.prod(spec.shape) * spec.itemsize <= limit and len(where[0]) == world)


def whole_spec(spec: ArraySpec, inner_bytes: int) -> ArraySpec:
    """One chunk for the whole array, its inner chunks (the sharding codec) no taller than
    the per-shard chunks it replaces; the chunk is padded to a whole number of them."""
    rows = layout.inner_rows(spec.chunks, spec.itemsize, inner_bytes)
    height = -(-spec.shape[0] // rows) * rows
    return ArraySpec(spec.name, spec.shape, spec.dtype, (height, *spec.shape[1:]),
                     rows if rows < height else None)


@dataclass(frozen=True)
class GatherLayout:
    """What a save's gathering of small arrays depends on, but the data: which plans it
    replaces, the bytes each rank sends, and per replaced plan its parts, its whole-array
    spec, this rank's pieces and the cells it writes."""

    picks: tuple[int, ...]
    sizes: tuple[int, ...]
    parts: tuple[tuple[layout.GatherPart, ...], ...]
    wholes: tuple[tuple[ArraySpec, tuple, tuple], ...]


@lru_cache(maxsize=16)
def gather_layout(statics: tuple, specs: tuple, rank: int, world: int, limit: int, inner_bytes: int,
                  budget: int) -> GatherLayout:
    """The gathering of a save whose plans were made from ``statics`` (``ArrayPlan.static``;
    ``specs`` their ArraySpecs). Pure, and cached: every save of a training run has the same
    layout, and working it out again (every rank's pieces of every array, the cells each
    writes) would hold up every save, in Python, before any byte moved."""
    picks, total = [], 0
    for i, (static, spec) in enumerate(zip(statics, specs)):
        if small_sharded(static, spec, limit, world):
            nbytes = math.prod(spec.shape) * spec.itemsize
            if total + nbytes > budget:
                break
            picks.append(i)
            total += nbytes
    if not picks:
        return GatherLayout((), (), (), ())
    sizes, parts = layout.gather_plan([(specs[i].itemsize, static_pieces(specs[i].shape, world, static_where(statics[i])))
                                       for i in picks])
    wholes = []
    for i in picks:
        spec = specs[i]
        whole = whole_spec(spec, inner_bytes)
        everyone = layout.replicated_pieces(spec.shape, world)
        wholes.append((whole, tuple(everyone[rank]),
                       tuple(layout.owned_cells(spec.shape, whole.chunks, everyone, rank, i))))
    return GatherLayout(tuple(picks), tuple(sizes), tuple(tuple(p) for p in parts), tuple(wholes))


def gather_small(plans: list[ArrayPlan], tensors: dict[str, torch.Tensor], rank: int, world: int,
                 limit: int = SMALL_ARRAY_BYTES, inner_bytes: int = 1 << 20,
                 budget: int = GATHER_BUDGET_BYTES) -> list[ArrayPlan]:
    """Replace the plans of small sharded arrays by single-chunk plans written by one rank.

    A collective on the default group: every rank must call it with the same
    arrays (as every rank of a save does). ``plans[i]`` was made with salt ``i``.
    """
    if world <= 1 or limit <= 0:
        return plans
    how = gather_layout(tuple(p.static for p in plans), tuple(p.spec for p in plans), rank, world, limit,
                        inner_bytes, budget)
    if not how.picks:
        return plans
    device = plans[how.picks[0]].local.device
    send = torch.zeros(max(how.sizes), dtype=torch.uint8, device=device)
    for i, array_parts in zip(how.picks, how.parts):
        plan = plans[i]
        for part in array_parts:
            if part.rank == rank:
                _region(send, part, plan.local.dtype).copy_(plan.local[part.piece.local_slices()])
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send)
    out = list(plans)
    for i, array_parts, (whole, mine, owned) in zip(how.picks, how.parts, how.wholes):
        plan, t = plans[i], tensors[plans[i].spec.name]
        if owned:
            full = torch.empty(plan.spec.shape, dtype=t.dtype, device=device)
            for part in array_parts:
                full[part.piece.box.slices()] = _region(recv[part.rank], part, t.dtype)
        else:
            full = plan.local   # this rank writes none of it: nothing to assemble
        out[i] = ArrayPlan(whole, mine, full, owned, plan.layout, plan.static)
    return out


def _region(buf: torch.Tensor, part: layout.GatherPart, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``part`` in a send/receive buffer, viewed as its region of the array."""
    shape = part.piece.box.shape
    n = math.prod(shape) * dtype.itemsize
    return buf[part.offset:part.offset + n].view(dtype).view(shape)

"""Layout math: which global box each rank holds, the chunk grid, who writes which chunk.

Pure functions over shapes, mesh shapes and placements; no I/O and no process
group. The per-dim index mapping of a placement list is computed by DTensor's
own splitting code (``placement._split_tensor`` on an index vector), so
torch's chunking rules (uneven and empty shards) are not re-derived here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Box:
    """A region of the global tensor: [offset, offset + shape) per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self, base: tuple[int, ...] | None = None) -> tuple[slice, ...]:
        """Slices of this box inside a tensor that holds the region starting at ``base``."""
        base = base or (0,) * len(self.offset)
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offset, base, self.shape))

    def contains(self, other: Box) -> bool:
        return all(a <= b and be <= ae for a, b, ae, be in zip(self.offset, other.offset, self.end, other.end))

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= a for a, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - a for a, h in zip(lo, hi)))


def full_box(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def placement_spec(p) -> tuple:
    """A hashable (kind, dim, split_factor) of a DTensor placement."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):
        return ("strided", p.dim, int(p.split_factor))
    if isinstance(p, Shard):
        return ("shard", p.dim, 1)
    if isinstance(p, Replicate):
        return ("replicate", -1, 1)
    raise ValueError(f"placement {p!r} cannot be checkpointed: reduce Partial DTensors "
                     "(redistribute to Replicate/Shard) first")


def _index_vector(length: int, dim: int, mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                  specs: tuple[tuple, ...]) -> torch.Tensor:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    idx = torch.arange(length, dtype=torch.int64)
    for mesh_dim, (kind, d, sf) in enumerate(specs):
        if kind == "replicate" or d != dim:
            continue
        p = _StridedShard(0, split_factor=sf) if kind == "strided" else Shard(0)
        pieces, _ = p._split_tensor(idx, mesh_shape[mesh_dim], with_padding=False, contiguous=True)
        idx = pieces[coord[mesh_dim]]
    return idx


@lru_cache(maxsize=8192)
def dim_runs(length: int, dim: int, mesh_shape: tuple[int, ...], coord: tuple[int, ...],
             specs: tuple[tuple, ...]) -> tuple[tuple[int, int, int], ...]:
    """(local_start, global_start, length) runs of consecutive global indices along ``dim``."""
    idx = _index_vector(length, dim, mesh_shape, coord, specs)
    if idx.numel() == 0:
        return ()
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, idx.numel()]
    return tuple((s, int(idx[s]), e - s) for s, e in zip(starts, ends))


@dataclass(frozen=True)
class Piece:
    """A contiguous part of a rank's local tensor: local[local:+box.shape] == global[box]."""

    local: tuple[int, ...]
    box: Box

    def local_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.local, self.box.shape))


def rank_pieces(shape: tuple[int, ...], ranks: Sequence[int], mesh_shape: tuple[int, ...],
                placements) -> dict[int, list[Piece]]:
    """Every mesh rank's pieces; ``ranks`` lists global ranks in C order over ``mesh_shape``.

    Shard/Replicate give one piece per rank; _StridedShard (FSDP2 over TP on
    the same dim) gives one piece per contiguous run of global rows. Cached:
    a save or load of many same-shaped tensors computes each layout once.
    """
    specs = tuple(placement_spec(p) for p in placements)
    return pieces_from_specs(shape, ranks, mesh_shape, specs)


def pieces_from_specs(shape: tuple[int, ...], ranks, mesh_shape: tuple[int, ...],
                      specs: tuple[tuple, ...]) -> dict[int, list[Piece]]:
    """``rank_pieces`` with placements given as ``placement_spec`` tuples."""
    cached = _rank_pieces(tuple(shape), tuple(int(r) for r in ranks), tuple(mesh_shape), specs)
    return {r: list(ps) for r, ps in cached.items()}


@lru_cache(maxsize=4096)
def _rank_pieces(shape: tuple[int, ...], ranks: tuple[int, ...], mesh_shape: tuple[int, ...],
                 specs: tuple[tuple, ...]) -> dict[int, tuple[Piece, ...]]:
    out: dict[int, tuple[Piece, ...]] = {}
    for coord, rank in zip(itertools.product(*[range(m) for m in mesh_shape]), ranks):
        per_dim = []
        for d, n in enumerate(shape):
            if any(k != "replicate" and dd == d for k, dd, _ in specs):
                r = dim_runs(n, d, mesh_shape, tuple(coord), specs)
            else:
                r = ((0, 0, n),)
            per_dim.append(r or ((0, 0, 0),))
        out[rank] = tuple(Piece(tuple(c[0] for c in combo),
                                Box(tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
                          for combo in itertools.product(*per_dim))
    return out


def replicated_pieces(shape: tuple[int, ...], world: int) -> dict[int, list[Piece]]:
    return {r: [Piece((0,) * len(shape), full_box(shape))] for r in range(world)}


def chunk_grid(shape: tuple[int, ...], pieces: dict[int, list[Piece]]) -> tuple[int, ...]:
    """A regular chunk shape whose cell boundaries include every box boundary.

    For torch.chunk shards this is the shard size (ceil division); for other
    nestings the gcd of all interior boundaries, so each chunk lies inside one
    box of every rank that holds it.
    """
    chunks = []
    for d, n in enumerate(shape):
        c = 0
        for b in (p.box for ps in pieces.values() for p in ps):
            if b.empty:
                continue
            for edge in (b.offset[d], b.end[d]):
                if 0 < edge < n:
                    c = math.gcd(c, edge)
        chunks.append(c if c else max(n, 1))
    return tuple(chunks)


def grid_shape(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // c) for n, c in zip(shape, chunks))


def cell_box(cell: tuple[int, ...], chunks: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """The in-bounds region of chunk ``cell``."""
    off = tuple(i * c for i, c in zip(cell, chunks))
    return Box(off, tuple(min(c, n - o) for o, c, n in zip(off, chunks, shape)))


def all_cells(shape: tuple[int, ...], chunks: tuple[int, ...]):
    return itertools.product(*[range(g) for g in grid_shape(shape, chunks)])


def owned_cells(shape: tuple[int, ...], chunks: tuple[int, ...], pieces: dict[int, list[Piece]],
                rank: int, salt: int, copies: tuple[int, int] = (0, 1)) -> list[tuple[tuple[int, ...], Piece]]:
    """The chunks ``rank`` writes. Holders of a chunk take turns (offset by ``salt``), so
    replicated arrays spread their writes over the replicas. Every chunk has one writer;
    returns (cell, the writer's piece holding it).

    ``copies``: (which, how many) identical copies of this layout the world holds (a
    DTensor on a sub-mesh: each sibling sub-mesh holds the same replica). The copies take
    turns too, so each chunk still has exactly one writer in the whole world."""
    which, count = copies
    out = []
    for linear, cell in enumerate(all_cells(shape, chunks)):
        turn = salt + linear
        if turn % count != which:
            continue
        turn //= count
        region = cell_box(cell, chunks, shape)
        holders = []
        for r in sorted(pieces):
            for p in pieces[r]:
                if not p.box.empty and p.box.contains(region):
                    holders.append((r, p))
                    break
        if not holders:
            raise ValueError(f"chunk {cell} of an array of shape {shape} is held by no rank")
        writer, piece = holders[turn % len(holders)]
        if writer == rank:
            out.append((cell, piece))
    return out


def cells_for_box(box: Box, chunks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Chunks of a regular grid that intersect ``box``."""
    if box.empty:
        return []
    return list(itertools.product(*[range(o // c, -(-e // c))
                                    for o, e, c in zip(box.offset, box.end, chunks)]))


def inner_rows(chunks: tuple[int, ...], itemsize: int, target_bytes: int, max_inner: int = 65536) -> int:
    """Rows (dim 0) per inner chunk of the sharding codec: a divisor of ``chunks[0]``,
    the largest whose inner chunk is at most ``target_bytes`` (at least 1 row)."""
    if not chunks:
        return 1
    row_bytes = math.prod(chunks[1:]) * itemsize
    rows = chunks[0]
    best = rows
    for d in range(1, rows + 1):
        if rows % d == 0 and d * row_bytes <= target_bytes:
            best = d
    if best == rows and rows * row_bytes > target_bytes:
        best = 1 if rows <= max_inner else rows
    if rows // best > max_inner:
        best = rows
    return best


@dataclass(frozen=True)
class GatherPart:
    """One region a rank sends when small sharded arrays are gathered whole."""

    rank: int            # the sender
    offset: int          # where it starts in the sender's buffer (bytes)
    piece: Piece         # the sender's piece holding the region


def gather_plan(arrays: list[tuple[int, dict[int, list[Piece]]]], align: int = 16
                ) -> tuple[list[int], list[list[GatherPart]]]:
    """How to all-gather arrays whole: each distinct region is sent once, by the lowest
    rank holding it, packed C-order into that rank's buffer (offsets ``align``-ed).

    ``arrays``: (itemsize, every rank's pieces) per array. Returns (bytes each rank
    sends, indexed by rank up to the highest rank seen; per array, its parts).
    """
    sent: dict[int, int] = {}
    parts: list[list[GatherPart]] = []
    for itemsize, pieces in arrays:
        seen: set[Box] = set()
        mine: list[GatherPart] = []
        for r in sorted(pieces):
            for p in pieces[r]:
                if p.box.empty or p.box in seen:
                    continue
                seen.add(p.box)
                at = -(-sent.get(r, 0) // align) * align
                mine.append(GatherPart(r, at, p))
                sent[r] = at + p.box.numel * itemsize
        parts.append(mine)
    sizes = [sent.get(r, 0) for r in range(max(sent, default=-1) + 1)]
    return sizes, parts

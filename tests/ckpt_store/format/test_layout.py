"""Pure layout math, chunk encoding and retention decisions, exhaustively, without processes."""

from __future__ import annotations

import itertools

import crc32c
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ckpt_store.format import layout, retention
from ckpt_store.format.zarr_format import ArraySpec, chunks_digest, embedded_crcs, encode_chunk

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", range(0, 23))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_pieces_match_torch_chunk_and_every_chunk_has_one_writer(n, world):
    pieces = layout.rank_pieces((n, 3), list(range(world)), (world,), [Shard(0)])
    chunks = torch.arange(n).chunk(world) if n else []
    for rank in range(world):
        (piece,) = pieces[rank]
        want = chunks[rank].tolist() if rank < len(chunks) else []
        got = list(range(piece.box.offset[0], piece.box.end[0]))
        assert got == want
    grid = layout.chunk_grid((n, 3), pieces)
    writers = {}
    for rank in range(world):
        for cell, _ in layout.owned_cells((n, 3), grid, pieces, rank, salt=0):
            assert cell not in writers
            writers[cell] = rank
    assert len(writers) == len(list(layout.all_cells((n, 3), grid)))


@pytest.mark.parametrize("n", [4, 7, 10, 13, 16])
@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 3), (4, 2)])
def test_strided_pieces_cover_the_tensor_once(n, dp, tp):
    shape = (n, 5)
    placements = [_StridedShard(0, split_factor=tp), Shard(0)]
    pieces = layout.rank_pieces(shape, list(range(dp * tp)), (dp, tp), placements)
    seen = torch.zeros(n, dtype=torch.int64)
    for ps in pieces.values():
        for p in ps:
            seen[p.box.offset[0]:p.box.end[0]] += 1
    assert seen.tolist() == [1] * n
    grid = layout.chunk_grid(shape, pieces)
    owners = [c for r in pieces for c, _ in layout.owned_cells(shape, grid, pieces, r, 0)]
    assert len(owners) == len(set(owners)) == len(list(layout.all_cells(shape, grid)))


def test_replicated_writes_spread_over_replicas():
    shape = (64, 4)
    pieces = layout.rank_pieces(shape, [0, 1, 2, 3], (2, 2), [Shard(0), Replicate()])
    grid = layout.chunk_grid(shape, pieces)
    per_rank = {r: len(layout.owned_cells(shape, grid, pieces, r, salt=0)) for r in range(4)}
    assert sum(per_rank.values()) == 2 and sum(1 for v in per_rank.values() if v) == 2
    many = {r: sum(len(layout.owned_cells((3,), (3,), layout.replicated_pieces((3,), 4), r, salt=s))
                   for s in range(8)) for r in range(4)}
    assert all(v == 2 for v in many.values())


def test_cells_for_box_and_intersections():
    box = layout.Box((3, 0), (5, 4))
    assert layout.cells_for_box(box, (4, 4)) == [(0, 0), (1, 0)]
    assert layout.cells_for_box(layout.Box((0,), (0,)), (4,)) == []
    assert layout.Box((0, 0), (4, 4)).intersect(layout.Box((4, 0), (2, 2))) is None


@pytest.mark.parametrize("rows,row_bytes,target", list(itertools.product([1, 7, 12, 331, 1024], [4, 4096], [64, 1 << 20])))
def test_inner_rows_divides_and_fits(rows, row_bytes, target):
    r = layout.inner_rows((rows, row_bytes // 4), 4, target)
    assert rows % r == 0
    assert r == 1 or r * row_bytes <= target or r == rows


def test_retention_keeps_newest_last_n_and_every_k():
    steps = [10, 20, 30, 40, 50, 60]
    assert retention.steps_to_delete(steps, keep_last=2, keep_every=None) == [10, 20, 30, 40]
    assert retention.steps_to_delete(steps, keep_last=2, keep_every=30) == [10, 20, 40]
    assert retention.steps_to_delete(steps, keep_last=0, keep_every=None) == [10, 20, 30, 40, 50]
    assert retention.steps_to_delete(steps, keep_last=None, keep_every=None) == []
    # a run that resumed from step 20 just committed 25: it keeps that and the newest
    assert retention.steps_to_delete(steps + [25], keep_last=1, keep_every=None, keep={25}) == [10, 20, 30, 40, 50]
    assert retention.leftovers_to_delete([5, 10, 15, 20, 25], [10, 20], {25}) == [5, 15]
    assert retention.leftovers_to_delete([5, 25], [], set()) == []


@pytest.mark.parametrize("inner_rows", [None, 2], ids=["plain", "sharded"])
def test_chunks_digest_tells_same_shaped_objects_apart_where_their_crc32c_cannot(inner_rows):
    spec = ArraySpec("w", (8, 4), "float32", (8, 4), inner_rows)
    objects = []
    for seed in (1, 2):
        data = np.random.default_rng(seed).standard_normal((8, 4)).astype("<f4").tobytes()
        pieces, size, crc, digest = encode_chunk(data, spec, valid_rows=8)
        raw = b"".join(bytes(p) for p in pieces)
        assert size == len(raw) and crc == crc32c.crc32c(raw)
        assert digest == chunks_digest(embedded_crcs("w/c/0/0", raw, spec)), "the reader's digest is the writer's"
        objects.append((crc, digest))
    (crc1, digest1), (crc2, digest2) = objects
    assert crc1 == crc2, "each piece ends in its own crc32c: the whole object's depends on lengths only"
    assert digest1 != digest2

"""gather_plan: which rank sends which region, and where, when small arrays are gathered whole."""

import math

import pytest

from ckpt_store.format import layout
from ckpt_store.format.layout import Box, Piece, gather_plan
from ckpt_store.format.zarr_format import ArraySpec
from ckpt_store.save.gather import whole_spec

pytestmark = pytest.mark.unit


def _pieces(shape, mesh_shape, specs):
    return layout.pieces_from_specs(shape, list(range(math.prod(mesh_shape))), mesh_shape, specs)


def test_each_region_is_sent_once_by_its_lowest_holder():
    # dim 0 sharded over 2 "dp" ranks, replicated over 2 "tp" ranks: ranks 0,1 hold rows 0-2, ranks 2,3 rows 3-4
    pieces = _pieces((5, 3), (2, 2), (("shard", 0, 1), ("replicate", -1, 1)))
    sizes, [parts] = gather_plan([(4, pieces)])
    assert [(p.rank, p.piece.box) for p in parts] == [(0, Box((0, 0), (3, 3))), (2, Box((3, 0), (2, 3)))]
    assert sizes == [36, 0, 24]


def test_offsets_pack_arrays_in_order_aligned_and_skip_empty_pieces():
    a = _pieces((3,), (4,), (("shard", 0, 1),))          # uneven: 1, 1, 1, 0 rows
    b = _pieces((2, 2), (4,), (("shard", 1, 1),))        # 1, 1, 0, 0 columns
    sizes, (pa, pb) = gather_plan([(2, a), (8, b)], align=16)
    assert [(p.rank, p.offset) for p in pa] == [(0, 0), (1, 0), (2, 0)]
    assert [(p.rank, p.offset) for p in pb] == [(0, 16), (1, 16)]
    assert sizes == [32, 32, 2]


def test_every_element_is_covered_exactly_once():
    shape = (7, 5)
    pieces = _pieces(shape, (2, 2), (("shard", 0, 1), ("shard", 1, 1)))
    _, [parts] = gather_plan([(4, pieces)])
    covered = {}
    for p in parts:
        b = p.piece.box
        for i in range(b.offset[0], b.end[0]):
            for j in range(b.offset[1], b.end[1]):
                covered[(i, j)] = covered.get((i, j), 0) + 1
    assert covered == {(i, j): 1 for i in range(7) for j in range(5)}


def test_nothing_to_send():
    assert gather_plan([]) == ([], [])
    assert gather_plan([(4, {0: [Piece((0,), Box((0,), (0,)))]})]) == ([], [[]])


def test_a_whole_array_keeps_the_shard_rows_as_inner_chunks():
    # 5 rows over 4 ranks were 2-row chunks: one chunk padded to 6 rows, inner chunks of 2
    assert whole_spec(ArraySpec("b", (5, 3), "float32", (2, 3), None), 1 << 20) == \
        ArraySpec("b", (5, 3), "float32", (6, 3), 2)
    # inner chunks no bigger than inner_bytes: 1 row of 12 bytes
    assert whole_spec(ArraySpec("b", (5, 3), "float32", (2, 3), None), 12) == \
        ArraySpec("b", (5, 3), "float32", (5, 3), 1)
    # an even split: no padding
    assert whole_spec(ArraySpec("n", (8,), "bfloat16", (2,), None), 1 << 20) == \
        ArraySpec("n", (8,), "bfloat16", (8,), 2)

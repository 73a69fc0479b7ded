"""The pure parts of the ranks' agreement and of the save's argument checks."""

from __future__ import annotations

import numpy as np
import pytest

from ckpt_store.agreement import layout_difference
from ckpt_store.format.steps import MAX_STEP, retention_count, step_number

pytestmark = pytest.mark.unit


def _rows(step, **arrays):
    return [step, *([name, *spec] for name, spec in sorted(arrays.items()))]


def test_layout_difference_names_the_steps_first():
    per_rank = [_rows(3, w=[[4], "torch.float32", None]), _rows(4, v=[[4], "torch.float32", None])]
    assert layout_difference(per_rank) == "steps by rank: {0: 3, 1: 4}"


def test_layout_difference_names_an_array_some_ranks_lack():
    common = [[4], "torch.float32", None]
    per_rank = [_rows(1, w=common), _rows(1, w=common, only_here=common), _rows(1, w=common)]
    assert layout_difference(per_rank) == "array 'only_here' is held by ranks [1] only"


def test_layout_difference_names_the_first_rank_that_differs():
    per_rank = [_rows(1, w=[[4], "torch.float32", None]), _rows(1, w=[[4], "torch.float32", None]),
                _rows(1, w=[[8], "torch.float32", None])]
    assert layout_difference(per_rank) == (
        "array 'w' is [[4], 'torch.float32', None] on rank 0 but [[8], 'torch.float32', None] on rank 2")


def test_layout_difference_without_one():
    rows = _rows(1, w=[[4], "torch.float32", None])
    assert layout_difference([rows, rows]) == "their digests differ"


def test_step_numbers():
    assert step_number(np.int64(7)) == 7 and type(step_number(np.int64(7))) is int
    assert step_number(0) == 0 and step_number(MAX_STEP) == MAX_STEP
    for bad, kind in ((-1, ValueError), (MAX_STEP + 1, ValueError), (2.5, TypeError), ("7", TypeError),
                      (True, TypeError)):
        with pytest.raises(kind, match="checkpoint step"):
            step_number(bad)


def test_retention_counts():
    assert retention_count("keep_last", None, 0) is None
    assert retention_count("keep_last", 0, 0) == 0 and retention_count("keep_every", np.int32(5), 1) == 5
    with pytest.raises(ValueError, match="keep_every=0: use an integer >= 1"):
        retention_count("keep_every", 0, 1)
    with pytest.raises(TypeError, match="keep_last=1.5"):
        retention_count("keep_last", 1.5, 0)
    with pytest.raises(TypeError, match="keep_last=True"):
        retention_count("keep_last", True, 0)

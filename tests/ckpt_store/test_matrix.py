"""Layout matrix on real gloo ranks: save under every layout with 1, 2 and 4 ranks, load each
into every other layout, bit-exact. Few launches: each run saves all its layouts and loads all
steps saved so far (2 ranks -> 4 ranks -> 2 ranks again -> this process with plain tensors)."""

from __future__ import annotations

import torch

from ckpt_store import CheckpointStore
from marind.testing.procs import run_torch_workers
from tests.ckpt_store import workers


def _save_single(url: str) -> int:
    store = CheckpointStore(url, inner_chunk_bytes=64)
    store.save(100, workers.make_state("rep"), async_=False)
    return 100


def test_every_layout_loads_into_every_other(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    one = _save_single(url)
    r2 = run_torch_workers("tests.ckpt_store.workers:matrix", 2, timeout=150,
                           url=url, save=True, load_steps=[one])
    assert r2[0]["failures"] == [] and r2[1]["failures"] == []
    _check_gathered(r2[0]["w_chunks"])
    r4 = run_torch_workers("tests.ckpt_store.workers:matrix", 4, timeout=200,
                           url=url, save=True, load_steps=[one, *r2[0]["saved"]])
    assert all(r["failures"] == [] for r in r4), [r["failures"] for r in r4]
    _check_gathered(r4[0]["w_chunks"])
    back = run_torch_workers("tests.ckpt_store.workers:matrix", 2, timeout=150,
                             url=url, save=False, load_steps=r4[0]["saved"])
    assert all(r["failures"] == [] for r in back), [r["failures"] for r in back]
    store = CheckpointStore(url)
    assert store.steps() == sorted([one, *r2[0]["saved"], *r4[0]["saved"]])
    for step in r4[0]["saved"]:   # every layout's arrays, gathered or not, read by other Zarr readers
        _check_other_readers(f"{tmp_path}/ckpt/step-{step:010d}")
    for step in store.steps():
        target = workers.make_state("rep", zeros=True)
        store.load(target, step=step)
        assert workers.check_state(target) == [], step
        assert target["extra"]["rank"] == 0  # rank 0's JSON values when this world has one rank
        assert store.verify(step).ok


def _check_other_readers(d: str) -> None:
    import numpy as np
    import tensorstore as ts
    import zarr

    for name in ("model/w", "model/b", "model/i", "optim/w/exp_avg"):
        want = workers.expected(name).numpy()
        got_z = zarr.open_array(f"{d}/{name}", mode="r")[...]
        got_t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{d}/{name}"}}).result()
        for got in (got_z, got_t.read().result()):
            assert np.array_equal(np.asarray(got), want), (d, name)


def _check_gathered(chunks: dict) -> None:
    """Small sharded arrays: one object when gathered, one per shard when not."""
    for step, grid in chunks.items():
        layout = workers.LAYOUTS[int(step) % 100]
        if layout in workers.GATHERED:
            assert grid == [10, 7], (step, layout, grid)
        elif layout in ("tp_row", "2d"):
            assert grid != [10, 7], (step, layout, grid)


def test_plain_tensors_roundtrip_in_process(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/c")
    state = workers.make_state("rep")
    store.save(1, state).wait()
    target = workers.make_state("rep", zeros=True)
    assert torch.count_nonzero(target["model"]["w"]) == 0
    store.load(target)
    assert workers.check_state(target) == []

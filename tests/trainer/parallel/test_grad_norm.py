"""Grad clipping: one all-reduce per device mesh (counted on real gloo ranks), and its accounting (pure)."""

from __future__ import annotations

import itertools

import pytest
import torch

from marind.testing.procs import run_torch_workers
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus
from marind.trainer.parallel.grad_norm import GradLayout, contributes, reduction_plan


def _chunks(t: torch.Tensor, placements: tuple[str, ...], dims: tuple[int, ...], shape: tuple[int, ...],
            coord: tuple[int, ...]) -> torch.Tensor:
    """The local piece of ``t`` at ``coord`` (``torch.chunk`` per sharded mesh dimension, in order)."""
    for p, d, n, c in zip(placements, dims, shape, coord, strict=True):
        if p == "S":
            pieces = list(torch.chunk(t, n, dim=d))
            t = pieces[c] if c < len(pieces) else t.narrow(d, 0, 0)
    return t


@pytest.mark.unit
@pytest.mark.parametrize("shape,placements,dims", [
    ((4,), ("S",), (0,)),                    # FSDP over dp_shard
    ((2, 2), ("R", "S"), (0, 0)),            # HSDP: replicate x shard
    ((2, 2), ("S", "S"), (0, 1)),            # FSDP x TP (row-wise)
    ((2, 2), ("S", "R"), (0, 0)),            # FSDP x TP-replicated (a norm on the 2-D mesh)
    ((3, 2, 2), ("R", "S", "S"), (0, 0, 1)),  # HSDP x TP, uneven shards
    ((2,), ("R",), (0,)),                    # replicated only
])
def test_each_element_is_counted_once(shape, placements, dims):
    full = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    total = torch.zeros((), dtype=torch.float64)
    for coord in itertools.product(*(range(n) for n in shape)):
        lay = GradLayout("m", int(torch.tensor(shape).prod()), placements, coord)
        if contributes(lay):
            total += (_chunks(full, placements, dims, shape, coord).double() ** 2).sum()
    assert torch.allclose(total, (full.double() ** 2).sum())


@pytest.mark.unit
def test_plan_groups_by_mesh_one_reduction_each():
    lays = [GradLayout("dp", 2, ("S",), (1,)), GradLayout("dp_tp", 4, ("S", "S"), (1, 0)),
            GradLayout("dp", 2, ("S",), (1,)), GradLayout("dp_tp", 4, ("S", "R"), (0, 1)),
            GradLayout("one", 1, ("S",), (0,)), GradLayout(None, 1, (), ())]
    plan = reduction_plan(lays)
    assert [r.mesh for r in plan] == ["dp", "dp_tp", "one", None]
    assert plan[0].counted == (0, 2) and plan[1].counted == (1,) and plan[1].dropped == (3,)
    assert [r.all_reduce for r in plan] == [True, True, False, False]
    hsdp = reduction_plan([GradLayout("h", 4, ("R", "S"), (1, 0))])[0]
    assert hsdp.counted == () and hsdp.dropped == (0,) and hsdp.all_reduce


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 20)
    return str(prefix)


def _spec(data: str, *, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, ep: int = 1,
          preset: str = "tiny") -> dict:
    return load_trainer_spec(f"""
[job]
name = "clip-test"
[model]
preset = "{preset}"
[parallel]
dp_replicate = {dp_replicate}
dp_shard = {dp_shard}
tp = {tp}
ep = {ep}
[data]
path = "{data}"
seq_len = 16
global_batch = 8
micro_batch = 1
""", check_worlds=False).to_dict()


@pytest.mark.parametrize("world,dp_replicate,dp_shard,tp,meshes", [
    (2, 1, 2, 1, 1), (2, 1, 1, 2, 1), (4, 1, 2, 2, 2), (4, 2, 2, 1, 1),
    pytest.param(8, 2, 2, 2, 2, marks=pytest.mark.slow)],     # 8 ranks: 31 s of CI's 2 cores
    ids=["fsdp2", "tp2", "fsdp2xtp2", "hsdp2x2", "hsdp2x2xtp2"])
def test_one_all_reduce_per_mesh(data, world, dp_replicate, dp_shard, tp, meshes):
    results = run_torch_workers("tests.trainer.workers:clip_collectives", world, timeout=240,
                                spec=_spec(data, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp))
    _one_all_reduce_per_mesh(results, meshes)


@pytest.mark.parametrize("world,pp,dp_shard,tp,meshes", [
    pytest.param(2, 2, 1, 1, 1, id="pp2"), pytest.param(4, 2, 1, 2, 2, id="pp2xtp2"),
    pytest.param(4, 2, 2, 1, 1, id="pp2xdp2", marks=pytest.mark.slow)])
def test_one_all_reduce_per_mesh_across_pipeline_stages(data, world, pp, dp_shard, tp, meshes):
    from tests.trainer.parallel.test_pipeline import pp_spec

    results = run_torch_workers("tests.trainer.pp_workers:pp_clip_collectives", world, timeout=240,
                                spec=pp_spec(data, pp=pp, dp_shard=dp_shard, tp=tp))
    _one_all_reduce_per_mesh(results, meshes)      # every stage clips by the same global norm


@pytest.mark.parametrize("world,dp_replicate,dp_shard,tp,ep,meshes", [
    (2, 1, 2, 1, 2, 2), pytest.param(4, 1, 4, 1, 2, 2, marks=pytest.mark.slow), (4, 1, 2, 2, 2, 3),
    pytest.param(4, 2, 2, 1, 2, 2, marks=pytest.mark.slow)],
    ids=["ep2", "ep2xdp_shard4", "ep2xtp2", "hsdp2xep2"])
def test_moe_one_all_reduce_per_mesh(data, world, dp_replicate, dp_shard, tp, ep, meshes):
    # the experts' gradients live on their own mesh ((dp_replicate,) edp_shard, ep): one more all-reduce
    results = run_torch_workers("tests.trainer.workers:clip_collectives", world, timeout=240,
                                spec=_spec(data, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep,
                                           preset="moe-tiny"))
    _one_all_reduce_per_mesh(results, meshes)


def _one_all_reduce_per_mesh(results: list[dict], meshes: int) -> None:
    for res in results:
        assert res["meshes"] == meshes and res["params"] > meshes
        for counts in (res["counts"], res["counts2"]):
            assert sum(counts.values()) == meshes, counts
            assert all("all_reduce" in k or "allreduce" in k for k in counts), counts
        assert abs(res["norm"] - res["ref"]) <= 1e-5 * res["ref"], res
    assert len({r["norm"] for r in results}) == 1

"""Mixture of experts on real gloo ranks: it learns with balanced experts, expert parallelism
matches one rank, and checkpoints reshard between ``ep=2 x dp_shard=4`` and one rank.

Layouts: ``ep2`` is 4 ranks, ``dp_shard = 4`` and ``ep = 2`` (two experts per rank, each expert
FSDP-sharded over 2 ranks); ``single`` is one rank.
"""

from __future__ import annotations

import pytest

from marind.testing.procs import run_torch_workers
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus
from tests.trainer.workers import check_reshard

STEPS = 8
SAVED = 4                 # the step the reshard tests resume from
GLOBAL_BATCH = 8
SEQ_LEN = 32
TOP_K = 2
MOE_LAYERS = 2            # moe-tiny: 2 blocks, both MoE
LAYOUTS = {"ep2": (4, 4, 2, 1), "single": (1, 1, 1, 1), "dp_shard=2": (2, 2, 1, 1), "tp=2": (2, 1, 1, 2)}


def _spec(data: str, ckpt: str | None, layout: str, *, steps: int = STEPS, model: str = "") -> dict:
    _, dp_shard, ep, tp = LAYOUTS[layout]
    checkpoint = f'[checkpoint]\nurl = "file://{ckpt}"\nevery_steps = {SAVED}\nkeep_last = 0\n' if ckpt else ""
    return load_trainer_spec(f"""
[job]
name = "moe-test"
[model]
preset = "moe-tiny"
{model}
[parallel]
dp_shard = {dp_shard}
ep = {ep}
tp = {tp}
[data]
path = "{data}"
seq_len = {SEQ_LEN}
global_batch = {GLOBAL_BATCH}
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 3
[train]
steps = {steps}
seed = 7
{checkpoint}""", check_worlds=False).to_dict()


def _train(data: str, ckpt, layout: str, **kwargs) -> dict:
    world = LAYOUTS[layout][0]
    return run_torch_workers("tests.trainer.workers:train_moe", world, timeout=400,
                             spec=_spec(data, str(ckpt) if ckpt else None, layout, **kwargs))[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Uninterrupted runs under ``ep2`` and ``single``, each with its checkpoints."""
    out = {}
    for layout in ("ep2", "single"):
        ckpt = tmp_path_factory.mktemp(f"ckpt-{layout}")
        out[layout] = (_train(data, ckpt, layout), ckpt)
    return out


def _balance_run(data: str, coef: float) -> dict:
    spec = _spec(data, None, "single", steps=30, model=f"load_balance_coef = {coef}")
    spec["optim"]["lr"] = 1e-3
    return run_torch_workers("tests.trainer.workers:train_moe", 1, timeout=400, spec=spec)[0]


def test_moe_learns_with_balanced_experts(data):
    res = _balance_run(data, 0.01)                  # the preset's default coefficient
    losses = res["losses"]
    assert len(losses) == 30 and losses[-1] < 0.8 * losses[0], losses
    assigned = GLOBAL_BATCH * SEQ_LEN * TOP_K * MOE_LAYERS
    for r in res["routers"]:
        assert sum(r["moe_tokens_per_expert"]) == assigned and r["moe_dropped"] == 0, r
        assert 0 < r["moe_z_loss"] and 0.9 * MOE_LAYERS <= r["moe_balance_loss"] < 1.5 * MOE_LAYERS, r
    # The bound: over the last 10 steps the least used expert of any layer gets on average at least
    # a fifth of its fair share of assignments. Without the balancing loss the router collapses
    # (an expert of some layer gets none: top-2 of 4 sends every token to the same two; the slow test below).
    assert sum(r["moe_load_min"] for r in res["routers"][-10:]) / 10 >= 0.2, res["routers"][-10:]


@pytest.mark.slow
def test_without_the_balancing_loss_the_router_collapses(data):
    # the contrast to the bound above: the same run with load_balance_coef = 0
    res = _balance_run(data, 0.0)
    assert sum(r["moe_load_min"] for r in res["routers"][-10:]) / 10 < 0.05, res["routers"][-10:]


def test_capacity_drops_assignments(data):
    res = _train(data, None, "single", steps=2, model="capacity_factor = 0.5")
    for r in res["routers"]:
        assigned = GLOBAL_BATCH * SEQ_LEN * TOP_K * MOE_LAYERS
        assert r["moe_dropped"] >= assigned // 2, r    # at most half the assignments fit
        assert sum(r["moe_tokens_per_expert"]) == assigned, r


def test_expert_parallel_matches_one_rank(runs):
    ep2, single = runs["ep2"][0], runs["single"][0]
    assert ep2["step"] == STEPS and len(ep2["losses"]) == STEPS
    for got, want in zip(ep2["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (ep2["losses"], single["losses"])
    # the same weights route the same tokens the same way: the first step's counts are equal
    assert ep2["routers"][0]["moe_tokens_per_expert"] == single["routers"][0]["moe_tokens_per_expert"]
    assert len(ep2["routers"]) == STEPS


@pytest.mark.slow     # CI: an ep=2 checkpoint reshards (test_reshard_resume), a dense resume is exact (test_resume)
def test_same_layout_ep_resume_is_bit_identical(data, runs, tmp_path):
    full = runs["ep2"][0]
    first = run_torch_workers("tests.trainer.workers:train_moe", 4, timeout=400, env={"MARIND_TEST_STOP_AT_STEP": 6},
                              spec=_spec(data, str(tmp_path), "ep2"))[0]
    assert first["stopped"] and first["step"] == 6 and first["last_checkpoint_step"] == 6    # saved at the stop
    res = _train(data, tmp_path, "ep2")
    assert res["step"] == STEPS and res["data_position"] == STEPS * GLOBAL_BATCH
    assert res["losses"] == full["losses"][6:]
    assert res["digests"] == full["digests"]
    assert any(k.endswith("experts.w1/exp_avg_sq") for k in res["digests"])


@pytest.mark.parametrize("saved,resumed", [("ep2", "single"),
                                           pytest.param("single", "ep2", marks=pytest.mark.slow),
                                           pytest.param("ep2", "dp_shard=2", marks=pytest.mark.slow),
                                           pytest.param("ep2", "tp=2", marks=pytest.mark.slow)])
def test_reshard_resume(data, runs, tmp_path, saved, resumed):
    full, full_ckpt = runs[saved]
    world = LAYOUTS[resumed][0]
    res = check_reshard(lambda ckpt: run_torch_workers("tests.trainer.pp_workers:resume_and_digest", world,
                                                       timeout=400, spec=_spec(data, ckpt, resumed)),
                        full_ckpt, tmp_path / "ckpt", SAVED, position=SAVED * GLOBAL_BATCH,
                        want_losses=full["losses"][SAVED:],
                        holds={"model/layers.0.feed_forward.experts.w2",
                               "optim/layers.1.feed_forward.experts.w1/exp_avg_sq"})[0]
    assert res["step"] == STEPS and res["data_position"] == STEPS * GLOBAL_BATCH

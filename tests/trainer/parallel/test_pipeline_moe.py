"""Mixture of experts through pipeline stages on real gloo ranks: ``moe-tiny`` with ``pp = 2``
learns like one rank (auxiliary losses and router statistics included), its checkpoints reshard
between pipeline, expert, tensor and data parallel layouts, and an interrupted run resumes bit
for bit.

Layouts (world, ``[parallel]`` keys): ``single`` 1 rank; ``pp2`` 2 ranks, one block per stage;
``pp2xdp2`` pp 2 x dp_shard 2; ``ep2xdp2`` dp_shard 4 = ep 2 x 2 (no pipeline); ``tp2xpp2``
tp 2 x pp 2; ``pp2xep2`` pp 2 x dp_shard 2 with ep 2 inside each stage; ``ep2`` dp_shard 2 = ep 2;
``hsdp-ep2`` dp_replicate 2 x dp_shard 2 = ep 2; ``pp2ac`` pp 2 with activation checkpointing;
``pp2i4`` pp 2 Interleaved1F1B with 4 blocks (against ``single4``). The auxiliary loss
coefficients are raised (``load_balance_coef = 1``, ``router_z_loss_coef = 0.1``) so that a
pipeline that lost them would leave the single rank's loss curve by far more than float noise.
"""

from __future__ import annotations

import pytest

from marind.testing.procs import run_torch_workers
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus
from tests.trainer.workers import check_reshard

STEPS = 6
SAVED_AT = 4
GLOBAL_BATCH = 8
SEQ_LEN = 32
ASSIGNED = GLOBAL_BATCH * SEQ_LEN * 2        # tokens x top_k, per MoE block and step
LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {}), "pp2": (2, {"pp": 2}), "pp2xdp2": (4, {"pp": 2, "dp_shard": 2}),
    "ep2xdp2": (4, {"dp_shard": 4, "ep": 2}), "ep2": (2, {"dp_shard": 2, "ep": 2}), "tp2xpp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1}),
    "pp2xep2": (4, {"pp": 2, "dp_shard": 2, "ep": 2}),
    "hsdp-ep2": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}),
    "pp2ac": (2, {"pp": 2, "ac": True}), "single4": (1, {"n_layers": 4}),
    "pp2i4": (2, {"pp": 2, "schedule": "Interleaved1F1B", "microbatches": 4, "n_layers": 4}),
}


def moe_spec(data: str, ckpt: str = "", *, pp: int = 1, dp_shard: int = -1, ep: int = 1, tp: int = 1,
             dp_replicate: int = 1, n_layers: int = 2, schedule: str = "1F1B", microbatches: int = 0,
             ac: bool = False) -> dict:
    """``moe-tiny`` (untied, strong aux losses) in any layout, checkpointing every 2 steps when ``ckpt``."""
    checkpoint = f'[checkpoint]\nurl = "file://{ckpt}"\nevery_steps = 2\nkeep_last = 0\n' if ckpt else ""
    return load_trainer_spec(f"""
[job]
name = "pp-moe-test"
[model]
preset = "moe-tiny"
tie_embeddings = false
n_layers = {n_layers}
load_balance_coef = 1.0
router_z_loss_coef = 0.1
[parallel]
dp_replicate = {dp_replicate}
dp_shard = {dp_shard}
ep = {ep}
tp = {tp}
pp = {pp}
pp_schedule = "{schedule}"
pp_microbatches = {microbatches}
activation_checkpointing = {str(ac).lower()}
[data]
path = "{data}"
seq_len = {SEQ_LEN}
global_batch = {GLOBAL_BATCH}
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 3
[train]
steps = {STEPS}
seed = 7
{checkpoint}""", check_worlds=False).to_dict()


def _train(data: str, name: str, ckpt: str = "", env: dict | None = None) -> list[dict]:
    world, layout = LAYOUTS[name]
    return run_torch_workers("tests.trainer.workers:train_moe", world, timeout=400, env=env,
                             spec=moe_spec(data, ckpt, **layout))


def _union(results: list[dict]) -> dict:
    out: dict = {}
    for res in results:
        for k, v in res["digests"].items():
            assert out.setdefault(k, v) == v, k
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """Each layout's uninterrupted run (every rank's result) and its checkpoints, computed on first use."""
    cache: dict = {}

    def get(name: str) -> tuple[list[dict], str]:
        if name not in cache:
            ckpt = str(tmp_path_factory.mktemp(f"saved-{name}"))
            cache[name] = (_train(data, name, ckpt), ckpt)
        return cache[name]
    return get


def check_learns_like_one_rank(saved, name: str, ref: str = "single") -> None:
    """``name``'s loss curve is the single rank's (``ref``) within float noise; so are its router statistics."""
    results, single = saved(name)[0], saved(ref)[0][0]
    blocks = LAYOUTS[ref][1].get("n_layers", 2)   # every block of moe-tiny is MoE
    want = single["losses"]
    assert len(want) == STEPS and want[-1] < 0.9 * want[0], want
    for res in results:   # every rank logs the same loss and router statistics
        assert res["losses"] == results[0]["losses"] and res["routers"] == results[0]["routers"]
    got = results[0]
    for g, w in zip(got["losses"], want, strict=True):
        assert abs(g - w) <= 1e-4 * abs(w), (got["losses"], want)
    routers = got["routers"]
    assert len(routers) == STEPS
    # the same weights route the same tokens: the first step's statistics are the single rank's
    assert routers[0]["moe_tokens_per_expert"] == single["routers"][0]["moe_tokens_per_expert"]
    for r, ref in zip(routers, single["routers"], strict=True):
        assert sum(r["moe_tokens_per_expert"]) == ASSIGNED * blocks and r["moe_dropped"] == 0, r  # each once
        for key in ("moe_balance_loss", "moe_z_loss"):   # summed over both stages' blocks, per sample
            assert abs(r[key] - ref[key]) <= 1e-3 * abs(ref[key]), (key, r, ref)


def test_pp2_moe_learns_like_one_rank(saved):
    check_learns_like_one_rank(saved, "pp2")


@pytest.mark.slow
@pytest.mark.parametrize("name,ref", [("pp2xep2", "single"), ("tp2xpp2", "single"), ("pp2ac", "single"),
                                      ("pp2i4", "single4")])
def test_pp2_moe_other_layouts_learn_like_one_rank(saved, name, ref):
    # ep or tp inside the stages, activation checkpointing (a recompute records nothing twice),
    # Interleaved1F1B (two virtual stages per rank, 4 blocks)
    check_learns_like_one_rank(saved, name, ref)


@pytest.mark.parametrize("name", ["ep2", pytest.param("pp2xep2", marks=pytest.mark.slow),
                                  pytest.param("hsdp-ep2", marks=pytest.mark.slow),
                                  pytest.param("ep2xdp2", marks=pytest.mark.slow)])
def test_expert_gradients_are_the_one_rank_mean(data, name):
    # The step's gradients (aux losses included) equal the single rank's, experts too: with one
    # edp_shard rank (ep = dp_shard) FSDP once divided the experts' gradients twice (half of the mean;
    # Adam hid it until a resume into another layout met the halved moments).
    single = run_torch_workers("tests.trainer.pp_workers:step_grad_norms", 1, timeout=240,
                               spec=moe_spec(data))[0]
    world, layout = LAYOUTS[name]
    got: dict = {}
    for res in run_torch_workers("tests.trainer.pp_workers:step_grad_norms", world, timeout=400,
                                 spec=moe_spec(data, **layout)):
        got.update(res)
    assert set(got) == set(single) and any("experts.w1" in k for k in got)
    bad = {k: (got[k], single[k]) for k in single if abs(got[k] - single[k]) > 1e-4 * abs(single[k])}
    assert not bad, bad


def _reshard(data: str, saved, tmp_path, src: str, dst: str) -> None:
    """Resume ``src``'s step-4 checkpoint in layout ``dst`` (``workers.check_reshard``)."""
    results, src_ckpt = saved(src)
    world, layout = LAYOUTS[dst]
    check_reshard(lambda ckpt: run_torch_workers("tests.trainer.pp_workers:resume_and_digest", world, timeout=400,
                                                 spec=moe_spec(data, ckpt, **layout)),
                  src_ckpt, tmp_path / "ckpt", SAVED_AT, position=SAVED_AT * GLOBAL_BATCH,
                  want_losses=results[0]["losses"][SAVED_AT:],
                  holds={"model/layers.1.feed_forward.experts.w2", "optim/layers.0.feed_forward.experts.w1/exp_avg_sq",
                         "model/layers.1.feed_forward.gate.weight", "model/output.weight"})


def test_reshard_pp2_moe_to_one_rank(data, saved, tmp_path):
    _reshard(data, saved, tmp_path, "pp2", "single")


#: the issue's reshard matrix for moe-tiny
MATRIX = ("pp2xdp2", "ep2xdp2", "tp2xpp2", "single")


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [(a, b) for a in MATRIX for b in MATRIX if a != b]
                         + [("pp2xep2", "single"), ("single", "pp2xep2"), ("ep2", "single")])
def test_reshard_matrix_moe(data, saved, tmp_path, src, dst):
    _reshard(data, saved, tmp_path, src, dst)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2xep2"])
def test_pp2_moe_interrupted_and_resumed_is_bit_identical(data, saved, tmp_path, name):
    full = saved(name)[0]
    ckpt = str(tmp_path / "ckpt")
    first = _train(data, name, ckpt, env={"MARIND_TEST_STOP_AT_STEP": 3})
    assert first[0]["stopped"] and first[0]["step"] == 3 and first[0]["last_checkpoint_step"] == 3   # saved at the stop
    second = _train(data, name, ckpt)
    assert second[0]["step"] == STEPS and second[0]["data_position"] == STEPS * GLOBAL_BATCH
    assert second[0]["losses"] == full[0]["losses"][3:]
    assert second[0]["routers"] == full[0]["routers"][3:]
    assert _union(second) == _union(full)
    assert any(k.endswith("experts.w1/exp_avg_sq") for k in _union(full))


@pytest.mark.unit
def test_attach_aux_adds_the_scaled_aux_gradient_and_records_once():
    import torch

    from marind.trainer.parallel.pipeline_moe import AuxSink, attach_aux, paused

    x = torch.tensor([1.0, -2.0], requires_grad=True)
    w = torch.tensor([3.0], requires_grad=True)
    sink = AuxSink(0, scale=0.25)
    stats = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = attach_aux(x * 2, (w ** 2).sum(), sink, stats)
    assert torch.equal(out, x.detach() * 2) and sink.total is None   # forward: identity, nothing recorded
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))           # the activations' gradient unchanged
    assert torch.equal(w.grad, torch.tensor([0.25 * 2 * 3.0]))     # d(scale x aux)/dw
    assert torch.equal(sink.take(), stats) and sink.take() is None
    with paused([sink]):                                            # metadata inference: not counted
        attach_aux(x * 2, (w ** 2).sum(), sink, stats).sum().backward()
    assert sink.take() is None


@pytest.mark.unit
def test_router_stats_lay_a_stage_into_the_unsplit_layout():
    import torch
    from torch import nn

    from marind.trainer.model.gpt import GPT, ModelConfig
    from marind.trainer.parallel.pipeline import StageModel
    from marind.trainer.parallel.pipeline_moe import install_sinks, moe_layer_count, router_stats

    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=4, n_heads=2, ffn_dim=32, seq_len=8, tie_embeddings=False,
                      n_experts=2, top_k=1, moe_every=2, moe_ffn_dim=8)
    with torch.device("meta"):
        gpt = GPT(cfg)
    second = StageModel(gpt, range(2, 4), first=False, last=True)      # blocks 2, 3: MoE block 3 only
    sinks = install_sinks([second], n_experts=2, moe_every=2, scale=0.5)
    assert [s.index for s in sinks] == [1] and moe_layer_count(n_layers=4, n_experts=2, moe_every=2) == 2
    assert isinstance(second.layers, nn.ModuleDict)
    sinks[0].record(torch.arange(5, dtype=torch.float64))
    sinks[0].record(torch.ones(5, dtype=torch.float64))
    got = router_stats(sinks, n_moe=2, n_experts=2, device=torch.device("cpu"))
    assert got.tolist() == [0.0] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0]   # row 1: the sum of both micro-batches
    assert router_stats(sinks, n_moe=2, n_experts=2, device=torch.device("cpu")).abs().sum() == 0   # reset

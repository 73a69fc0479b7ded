"""Mixture of experts without processes: the layer against a per-token reference, capacity, the
all-to-all arithmetic, router statistics, parameter counts, presets and the spec's one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from marind.core.errors import SpecError
from marind.trainer.config import load_trainer_spec, validate_for_world
from marind.trainer.model.gpt import GPT, ModelConfig, flops_per_token, param_count
from marind.trainer.model.moe import MoE, MoEConfig, expert_capacity, router_summary, take_moe_outputs
from marind.trainer.parallel.expert import split_sizes

pytestmark = pytest.mark.unit


def _spec(model: str = "", parallel: str = "", nodes: str = "1", nproc: int = 1, preset: str = "moe-tiny"):
    return load_trainer_spec(f"""
[job]
nodes = "{nodes}"
nproc_per_node = {nproc}
[model]
preset = "{preset}"
{model}
[parallel]
{parallel}
[data]
path = "x"
global_batch = 8
micro_batch = 1
""")


def _err(**kwargs) -> str:
    with pytest.raises(SpecError) as info:
        _spec(**kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def _layer(**kw) -> MoE:
    cfg = MoEConfig(**({"dim": 8, "n_experts": 4, "top_k": 2, "moe_ffn_dim": 6} | kw))
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def test_moe_layer_equals_a_per_token_reference():
    layer = _layer(n_shared_experts=1)
    x = torch.randn(2, 5, 8)
    out = layer(x)
    tokens = x.reshape(-1, 8)
    probs = F.linear(tokens, layer.gate.weight).softmax(-1)
    ex = layer.experts
    want = []
    for t, p in zip(tokens, probs):
        top_p, top_i = p.topk(2)
        y = sum(w / top_p.sum() * ((F.silu(t @ ex.w1[e]) * (t @ ex.w3[e])) @ ex.w2[e]) for w, e in zip(top_p, top_i))
        assert layer.shared is not None
        want.append(y + layer.shared(t))
    assert torch.allclose(out.reshape(-1, 8), torch.stack(want), atol=1e-5)
    moe = take_moe_outputs(layer)
    assert moe is not None and take_moe_outputs(layer) is None     # taken once
    stats = moe.stats[0]
    assert stats[:4].sum() == 20 and stats[4] == 0                 # 10 tokens x top 2, none dropped
    balance, z = float(stats[5]), float(stats[6])
    assert balance > 0.5 and z > 0
    assert torch.isclose(moe.aux_loss, torch.tensor(0.0))            # both coefficients 0
    out.sum().backward()
    assert ex.w1.grad is not None and layer.gate.weight.grad is not None


def test_aux_loss_weights_the_balance_and_z_losses():
    layer = _layer(load_balance_coef=0.5, router_z_loss_coef=0.25)
    layer(torch.randn(1, 6, 8))
    moe = take_moe_outputs(layer)
    assert moe is not None
    balance, z = moe.stats[0, 5], moe.stats[0, 6]
    assert torch.isclose(moe.aux_loss.double(), 0.5 * balance + 0.25 * z)
    moe.aux_loss.backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_capacity_drops_the_latest_assignments():
    assert expert_capacity(10, top_k=2, n_experts=4, capacity_factor=0) is None
    assert expert_capacity(10, top_k=2, n_experts=4, capacity_factor=1.0) == 5
    assert expert_capacity(1, top_k=1, n_experts=8, capacity_factor=0.1) == 1
    layer = _layer(top_k=1, capacity_factor=0.25)          # 16 tokens, 4 experts: 1 assignment each
    x = torch.randn(1, 16, 8)
    layer(x)
    moe = take_moe_outputs(layer)
    assert moe is not None
    counts, dropped = moe.stats[0, :4], moe.stats[0, 4]
    assert counts.sum() == 16 and dropped == 16 - int((counts > 0).sum())


def test_split_sizes():
    # 4 experts on 2 ranks; this rank sends 3,1 to rank 0's experts and 0,2 to rank 1's;
    # it receives 3,1 from itself and 5,0 from the other rank for its own two experts
    assert split_sizes([3, 1, 0, 2], [3, 1, 5, 0], 2) == ([4, 2], [4, 5], [8, 1])
    assert split_sizes([1, 2], [1, 2], 1) == ([3], [3], [1, 2])


def test_router_summary():
    # 2 layers, 2 experts, summed over 2 TP replicas and 4 (rank, micro-batch) samples
    stats = torch.tensor([[8.0, 8.0, 0.0, 4.0, 8.0], [12.0, 4.0, 2.0, 4.4, 8.8]], dtype=torch.float64)
    s = router_summary(stats, replicas=2, samples=4)
    assert s["moe_tokens_per_expert"] == [10, 6]
    assert s["moe_load_min"] == 0.5 and s["moe_load_max"] == 1.5 and s["moe_dropped"] == 1
    assert s["moe_balance_loss"] == pytest.approx(2.1) and s["moe_z_loss"] == pytest.approx(4.2)


@pytest.mark.parametrize("n_layers,moe_every,shared,tied", [(2, 1, 1, True), (3, 2, 0, False), (4, 3, 2, True)])
def test_param_count_matches_modules(n_layers, moe_every, shared, tied):
    cfg = ModelConfig(vocab_size=40, dim=16, n_layers=n_layers, n_heads=2, ffn_dim=32, seq_len=8, tie_embeddings=tied,
                      n_experts=4, top_k=2, n_shared_experts=shared, moe_every=moe_every, moe_ffn_dim=12)
    model = GPT(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    moe_blocks = [i for i, b in enumerate(model.layers) if isinstance(b.feed_forward, MoE)]
    assert moe_blocks == [i for i in range(n_layers) if (i + 1) % moe_every == 0]
    per_expert = 3 * 16 * 12
    assert param_count(cfg) - param_count(cfg, active=True) == len(moe_blocks) * 2 * per_expert


def test_presets_and_flops():
    tiny = _spec().model
    assert (tiny.n_experts, tiny.top_k, tiny.n_shared_experts, tiny.moe_ffn_dim) == (4, 2, 1, 64)
    assert _spec(model="top_k = 1\nmoe_ffn_dim = 32").model.moe_ffn_dim == 32
    dense_width = load_trainer_spec('[model]\npreset = "custom"\ndim = 64\nn_layers = 2\nn_heads = 4\n'
                                    'n_experts = 4\n[data]\npath = "x"\n').model
    assert dense_width.moe_ffn_dim == dense_width.ffn_dim              # 0 resolves to ffn_dim
    big = load_trainer_spec('[model]\npreset = "mixtral-8x7b"\n[data]\npath = "x"\n').model
    cfg = ModelConfig.from_spec(big, seq_len=4096, data_vocab_size=32000)
    total, active = param_count(cfg), param_count(cfg, active=True)
    assert 45e9 < total < 50e9 and 12e9 < active < 15e9               # Mixtral: 46.7B / 12.9B with GQA
    assert 6 * active < flops_per_token(cfg) < 6 * total


@pytest.mark.parametrize("kwargs,needle", [
    ({"model": "top_k = 5"}, "model.top_k = 5 must be in [1, model.n_experts = 4]"),
    ({"model": "top_k = 0"}, "model.top_k = 0"),
    ({"model": "moe_every = 0"}, "model.moe_every must be >= 1"),
    ({"model": "moe_every = 3"}, "model.moe_every = 3 exceeds model.n_layers = 2"),
    ({"model": "n_experts = -1"}, "model.n_experts must be >= 0"),
    ({"model": "n_shared_experts = -1"}, "model.n_shared_experts must be >= 0"),
    ({"model": "moe_ffn_dim = -4"}, "model.moe_ffn_dim must be > 0"),
    ({"model": "capacity_factor = -1.0"}, "model.capacity_factor must be >= 0"),
    ({"model": "router_z_loss_coef = -0.1"}, "model.router_z_loss_coef must be >= 0"),
    ({"model": "load_balance_coef = -0.1"}, "model.load_balance_coef must be >= 0"),
    ({"parallel": "ep = 0"}, "parallel.ep must be >= 1"),
    ({"parallel": "ep = 3", "nproc": 3}, "parallel.ep = 3 must divide model.n_experts = 4"),
    ({"model": "n_experts = 0", "parallel": "ep = 2", "nproc": 2}, "parallel.ep = 2 needs a mixture-of-experts"),
    ({"model": "n_shared_experts = 1\nmoe_ffn_dim = 66", "parallel": "tp = 4", "nproc": 4},
     "parallel.tp = 4 must divide the shared experts' width"),
    ({"parallel": "ep = 2\ndp_shard = 1\ntp = 2", "nproc": 2}, "parallel.ep = 2 must divide parallel.dp_shard = 1"),
    ({"parallel": "ep = 4", "nodes": "1:2", "nproc": 2}, "parallel.ep = 4 must divide parallel.dp_shard = 2"),
    ({"preset": "moe-tinny"}, "did you mean 'moe-tiny'"),
    ({"model": 'init_from = "/models/llama"'}, "model.init_from loads a dense Llama"),
])
def test_spec_errors(kwargs, needle):
    assert needle in _err(**kwargs)


def test_ep_borrows_from_dp_shard():
    spec = _spec(parallel="ep = 2", nodes="1:2", nproc=2)   # worlds 2 and 4: dp_shard 2 and 4
    assert validate_for_world(spec, 4) == (1, 4, 1)
    with pytest.raises(SpecError, match="must divide parallel.dp_shard = 1"):
        validate_for_world(spec, 1)


def test_hf_export_refuses_a_moe_checkpoint():
    from marind.trainer.hf.export import export_plan

    manifest = {"arrays": {"model/layers.0.feed_forward.experts.w1": {"shape": [4, 8, 6]},
                           "model/tok_embeddings.weight": {"shape": [32, 8]}}}
    with pytest.raises(ValueError, match="mixture-of-experts model .* --format safetensors"):
        export_plan(manifest, {})

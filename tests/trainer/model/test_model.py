"""Model arithmetic (pure): parameter count and FLOPs match the modules."""

from __future__ import annotations

import pytest
import torch

from marind.trainer.config import PRESETS, swiglu_hidden
from marind.trainer.model.gpt import GPT, ModelConfig, flops_per_token, param_count

pytestmark = pytest.mark.unit  # no process, no server


def test_param_count_matches_modules():
    for tie in (True, False):
        cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=192, seq_len=16,
                          tie_embeddings=tie)
        assert param_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_presets_sizes():
    dim, layers, heads = PRESETS["1.3b"]
    assert (dim, layers, heads) == (2048, 24, 16)
    cfg = ModelConfig(vocab_size=50304, dim=dim, n_layers=layers, n_heads=heads, ffn_dim=swiglu_hidden(dim),
                      seq_len=2048)
    assert 1.2e9 < param_count(cfg) < 1.45e9
    assert flops_per_token(cfg) > 6 * param_count(cfg, embedding=False)


def test_causal():
    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, ffn_dim=64, seq_len=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 32, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 32
    assert torch.allclose(model(x)[0, :5], model(y)[0, :5], atol=1e-6)

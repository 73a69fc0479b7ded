"""The trainer <-> Llama mapping: names, rotary layout, config (pure)."""

from __future__ import annotations

import pytest
import torch

from marind.trainer.hf import mapping as hm
from marind.trainer.model.gpt import ModelConfig, apply_rotary, rotary_tables

pytestmark = pytest.mark.unit

CFG = {"vocab_size": 50, "dim": 16, "n_layers": 2, "n_heads": 2, "ffn_dim": 48, "seq_len": 8,
       "tie_embeddings": False, "norm_eps": 1e-6, "rope_theta": 500.0}


def test_every_parameter_maps_to_its_llama_name_and_back():
    names = list(hm.expected_shapes(CFG))
    hf = {n: hm.hf_name(n) for n in names}
    assert hf["tok_embeddings.weight"] == "model.embed_tokens.weight"
    assert hf["output.weight"] == "lm_head.weight"
    assert hf["layers.1.attention.wk.weight"] == "model.layers.1.self_attn.k_proj.weight"
    assert hf["layers.0.feed_forward.w1.weight"] == "model.layers.0.mlp.gate_proj.weight"
    assert hf["layers.0.feed_forward.w3.weight"] == "model.layers.0.mlp.up_proj.weight"
    assert hf["layers.0.feed_forward.w2.weight"] == "model.layers.0.mlp.down_proj.weight"
    assert hf["layers.1.ffn_norm.weight"] == "model.layers.1.post_attention_layernorm.weight"
    assert len(set(hf.values())) == len(names)
    assert all(hm.trainer_name(h) == n for n, h in hf.items())


def test_names_of_other_models_are_refused():
    with pytest.raises(ValueError, match="not a parameter"):
        hm.hf_name("layers.0.attention.wq.bias")
    with pytest.raises(ValueError, match="no counterpart"):
        hm.trainer_name("model.layers.0.self_attn.q_proj.bias")


def test_expected_shapes_count_matches_the_model():
    from marind.trainer.model.gpt import param_count
    n = sum(torch.Size(s).numel() for s in hm.expected_shapes(CFG).values())
    assert n == param_count(ModelConfig(**CFG))
    assert "output.weight" not in hm.expected_shapes({**CFG, "tie_embeddings": True})


def _rotate_half(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * torch.cat((cos, cos), -1)[:, None, :] + rot * torch.cat((sin, sin), -1)[:, None, :]


def test_permuted_rotary_matches_llamas_rotate_half():
    heads, hd, dim, t = 2, 8, 16, 5
    w = torch.randn(heads * hd, dim)
    x = torch.randn(1, t, dim)
    cos, sin = rotary_tables(hd, t, 500.0)
    ours = apply_rotary((x @ w.T).view(1, t, heads, hd), cos, sin)
    theirs = _rotate_half((x @ hm.to_hf_rotary(w, heads).T).view(1, t, heads, hd), cos[:t], sin[:t])
    # the same rotated values, in Llama's order within each head
    assert torch.allclose(hm.to_hf_rotary(ours.reshape(t, -1).T, heads).T.reshape(1, t, heads, hd), theirs,
                          atol=1e-6)
    assert torch.equal(hm.from_hf_rotary(hm.to_hf_rotary(w, heads), heads), w)
    assert not torch.equal(hm.to_hf_rotary(w, heads), w)
    assert hm.needs_rotary_permute("layers.3.attention.wq.weight")
    assert not hm.needs_rotary_permute("layers.3.attention.wv.weight")


def test_config_round_trips_through_llama():
    hf = hm.hf_config(CFG)
    assert hf["num_key_value_heads"] == 2 and hf["head_dim"] == 8 and hf["intermediate_size"] == 48
    assert hf["rope_parameters"]["rope_theta"] == 500.0 and hf["rms_norm_eps"] == 1e-6
    assert hm.model_config_from_hf(hf) == CFG
    assert hm.config_mismatch({**CFG, "seq_len": 1024, "vocab_size": None}, CFG) is None


@pytest.mark.parametrize("key, value, words", [
    ("num_key_value_heads", 1, "grouped-query"),
    ("attention_bias", True, "attention biases"),
    ("hidden_act", "gelu", "activation"),
    ("model_type", "mistral", "model_type"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1.0}, "rope type"),
])
def test_llama_configs_the_gpt_cannot_hold_are_refused(key, value, words):
    with pytest.raises(ValueError, match=words):
        hm.model_config_from_hf({**hm.hf_config(CFG), key: value})


def test_config_mismatch_names_the_key_and_the_fix():
    msg = hm.config_mismatch({**CFG, "n_heads": 4}, CFG)
    assert msg and "model.n_heads = 4" in msg and "set model.n_heads = 2" in msg
    assert hm.config_mismatch({**CFG, "norm_eps": 1e-5}, CFG)


def test_shape_problems_lists_every_problem():
    shapes = dict(hm.expected_shapes(CFG))
    assert hm.shape_problems(CFG, shapes) == []
    del shapes["norm.weight"]
    shapes["layers.0.attention.wq.weight"] = (3, 3)
    shapes["extra.weight"] = (1,)
    assert hm.shape_problems(CFG, shapes) == [
        "missing norm.weight", "unexpected extra.weight",
        "layers.0.attention.wq.weight has shape [3, 3], the config needs [16, 16]"]

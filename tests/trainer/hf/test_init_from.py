"""Reading a Hugging Face directory back into the trainer's names (files in tmp_path, no processes)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from marind.trainer.hf import mapping as hm
from marind.trainer.hf.init_from import InitFromError, read_hf_state, weight_files

pytestmark = pytest.mark.unit

CFG = {"vocab_size": 40, "dim": 16, "n_layers": 2, "n_heads": 4, "ffn_dim": 32, "seq_len": 8,
       "tie_embeddings": True, "norm_eps": 1e-5, "rope_theta": 10000.0}


def _hf_dir(tmp_path, cfg=CFG, extra=None):
    ours = {n: torch.randn(s) for n, s in hm.expected_shapes(cfg).items()}
    theirs = {hm.hf_name(n): hm.to_hf_rotary(t, cfg["n_heads"]) if hm.needs_rotary_permute(n) else t
              for n, t in ours.items()}
    save_file({**theirs, **(extra or {})}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hm.hf_config(cfg)))
    return ours


def test_read_back_gives_the_trainers_tensors(tmp_path):
    ours = _hf_dir(tmp_path, extra={"lm_head.weight": torch.zeros(40, 16)})   # tied: the head is ignored
    back = read_hf_state(tmp_path, CFG)
    assert set(back) == set(ours) and all(torch.equal(back[n], t) for n, t in ours.items())
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]


def test_a_directory_that_does_not_fit_is_refused_in_one_line(tmp_path):
    _hf_dir(tmp_path)
    with pytest.raises(InitFromError, match="model.rope_theta = 500.0 but the init_from model has 10000.0"):
        read_hf_state(tmp_path, {**CFG, "rope_theta": 500.0})
    with pytest.raises(InitFromError, match="model.vocab_size = 64"):
        read_hf_state(tmp_path, {**CFG, "vocab_size": 64})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(InitFromError, match="no model.safetensors"):
        read_hf_state(tmp_path, CFG)


def test_tensors_the_gpt_has_no_place_for_are_refused(tmp_path):
    _hf_dir(tmp_path, extra={"model.layers.0.self_attn.q_proj.bias": torch.zeros(16)})
    with pytest.raises(InitFromError, match="q_proj.bias.*no counterpart"):
        read_hf_state(tmp_path, CFG)

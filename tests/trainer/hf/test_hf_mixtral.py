"""`marind ckpt export --format hf` of a mixture-of-experts checkpoint written under expert
parallelism: ``transformers``' ``MixtralForCausalLM`` loads it and gives the trainer's logits."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_store import CheckpointStore
from ckpt_store.export.sharded import INDEX_FILE
from marind.testing.procs import run_torch_workers
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus
from marind.trainer.hf.mixtral import mixtral_problem
from tests.trainer.hf.test_hf_export import SEQ, _marind, _trainer_model

transformers = pytest.importorskip("transformers")


@pytest.mark.unit
def test_only_mixtral_shaped_models_export():
    assert mixtral_problem({"n_experts": 4, "n_shared_experts": 0, "moe_every": 1}) is None
    assert "shared experts" in (mixtral_problem({"n_experts": 4, "n_shared_experts": 1}) or "")
    assert "moe_every = 2" in (mixtral_problem({"n_experts": 4, "moe_every": 2}) or "")


def test_mixtral_export_gives_the_trainers_logits(tmp_path):
    prefix = tmp_path / "corpus"
    corpus.write_example_dataset(prefix, 20)
    ckpt = tmp_path / "ckpt"
    spec = load_trainer_spec(f"""
[job]
name = "mixtral-test"
[model]
preset = "moe-tiny"
n_shared_experts = 0
tie_embeddings = false
[parallel]
dp_shard = 2
ep = 2
[data]
path = "{prefix}"
seq_len = {SEQ}
global_batch = 4
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 1
[train]
steps = 3
seed = 5
[checkpoint]
url = "file://{ckpt}"
every_steps = 100
""", check_worlds=False).to_dict()
    assert run_torch_workers("tests.trainer.workers:train_and_digest", 2, timeout=300,
                             spec=spec)[0]["last_checkpoint_step"] == 3
    out = tmp_path / "hf"
    res = _marind("export", f"file://{ckpt}", "--step", "3", "--format", "hf", str(out), "--max-shard-size", "60KB")
    assert res.returncode == 0, res.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    weights = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in weights
    assert "model.layers.0.block_sparse_moe.gate.weight" in weights

    ours = _trainer_model(CheckpointStore(f"file://{ckpt}"), 3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(theirs).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(tokens)
        got = theirs(input_ids=tokens).logits
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs logit difference {diff}"
    assert want.abs().max().item() > 0.1

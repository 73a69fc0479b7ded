"""Pipeline parallelism on real gloo ranks: same initial weights, learning, resume, clipping."""

from __future__ import annotations

import pytest

from marind.testing.procs import run_torch_workers
from marind.trainer import corpus
from marind.trainer.config import load_trainer_spec

STEPS = 6
GLOBAL_BATCH = 8


def pp_spec(data: str, ckpt: str = "", *, pp: int = 1, dp_shard: int = -1, tp: int = 1, schedule: str = "1F1B",
            microbatches: int = 0, steps: int = STEPS, every: int = 2, seed: int = 7, n_layers: int = 4) -> dict:
    """A tiny untied model's spec in any layout (checkpoints every ``every`` steps when ``ckpt``)."""
    checkpoint = f'[checkpoint]\nurl = "file://{ckpt}"\nevery_steps = {every}\nkeep_last = 0\n' if ckpt else ""
    return load_trainer_spec(f"""
[job]
name = "pp-test"
[model]
preset = "tiny"
n_layers = {n_layers}
tie_embeddings = false
[parallel]
dp_shard = {dp_shard}
tp = {tp}
pp = {pp}
pp_schedule = "{schedule}"
pp_microbatches = {microbatches}
[data]
path = "{data}"
seq_len = 16
global_batch = {GLOBAL_BATCH}
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {steps}
seed = {seed}
{checkpoint}""", check_worlds=False).to_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 20)
    return str(prefix)


def _union(results: list[dict]) -> dict:
    out: dict = {}
    for res in results:
        for k, v in res["digests"].items():
            assert out.setdefault(k, v) == v, k
    return out


def test_same_initial_weights_as_one_rank(data):
    single = run_torch_workers("tests.trainer.workers:initial_digests", 1, timeout=240, spec=pp_spec(data))[0]
    split = run_torch_workers("tests.trainer.workers:initial_digests", 2, timeout=240, spec=pp_spec(data, pp=2))
    assert not set(split[0]["digests"]) & set(split[1]["digests"])   # each stage holds its own layers
    assert {"tok_embeddings.weight", "layers.1.attention.wq.weight"} <= set(split[0]["digests"])
    assert {"layers.2.attention.wq.weight", "layers.3.feed_forward.w2.weight", "norm.weight",
            "output.weight"} <= set(split[1]["digests"])   # global names, not stage-local ones
    assert _union(split) == single["digests"]


@pytest.fixture(scope="module")
def single_run(data):
    return run_torch_workers("tests.trainer.workers:train_and_digest", 1, timeout=240, spec=pp_spec(data))[0]


@pytest.mark.parametrize("schedule,microbatches", [("1F1B", 4), ("GPipe", 2), ("Interleaved1F1B", 4)])
def test_pp2_learns_like_one_rank(data, single_run, schedule, microbatches):
    results = run_torch_workers("tests.trainer.workers:train_and_digest", 2, timeout=240,
                                spec=pp_spec(data, pp=2, schedule=schedule, microbatches=microbatches))
    assert results[0]["losses"] == results[1]["losses"]        # every stage logs the last stage's loss
    want = single_run["losses"]
    assert want[-1] < 0.9 * want[0]
    for got, ref in zip(results[0]["losses"], want, strict=True):
        assert abs(got - ref) <= 1e-4 * abs(ref), (results[0]["losses"], want)

"""Pipeline parallelism on real gloo ranks: same initial weights, learning, resume, clipping."""

from __future__ import annotations

import pytest

from marind.testing.procs import run_torch_workers
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus
from tests.trainer.workers import check_reshard

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


@pytest.mark.parametrize("schedule,microbatches", [
    ("1F1B", 4), pytest.param("GPipe", 2, marks=pytest.mark.slow),
    pytest.param("Interleaved1F1B", 4, marks=pytest.mark.slow)])
def test_pp2_learns_like_one_rank(data, single_run, schedule, microbatches):
    results = run_torch_workers("tests.trainer.workers:train_and_digest", 2, timeout=240,
                                spec=pp_spec(data, pp=2, schedule=schedule, microbatches=microbatches))
    assert results[0]["losses"] == results[1]["losses"]        # every stage logs the last stage's loss
    want = single_run["losses"]
    assert want[-1] < 0.9 * want[0]
    for got, ref in zip(results[0]["losses"], want, strict=True):
        assert abs(got - ref) <= 1e-4 * abs(ref), (results[0]["losses"], want)


def _train(data: str, world: int, ckpt: str = "", env: dict | None = None, **layout) -> list[dict]:
    return run_torch_workers("tests.trainer.workers:train_and_digest", world, timeout=300, env=env,
                             spec=pp_spec(data, ckpt, **layout))


def test_pp2_interrupted_and_resumed_is_bit_identical(data, tmp_path):
    full = _train(data, 2, str(tmp_path / "full"), pp=2)
    ckpt = str(tmp_path / "ckpt")
    first = _train(data, 2, ckpt, env={"MARIND_TEST_STOP_AT_STEP": 3}, pp=2)
    assert first[0]["stopped"] and first[0]["step"] == 3 and first[0]["last_checkpoint_step"] == 3   # saved at the stop
    second = _train(data, 2, ckpt, pp=2)
    assert second[0]["step"] == STEPS and second[0]["data_position"] == STEPS * GLOBAL_BATCH
    assert second[0]["losses"] == full[0]["losses"][3:]
    assert _union(second) == _union(full)
    assert any(k.endswith("/exp_avg_sq") for k in _union(full))


#: layouts of the reshard matrix: (world, layout keywords)
LAYOUTS = {"pp2xdp2": (4, {"pp": 2, "dp_shard": 2}), "tp2xpp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1}),
           "single": (1, {}), "pp2": (2, {"pp": 2}),
           "pp2i": (2, {"pp": 2, "schedule": "Interleaved1F1B", "microbatches": 4})}   # 2 virtual stages each
SAVED_AT = 4


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """Each layout's uninterrupted run (checkpoints every 2 steps), computed on first use."""
    cache: dict = {}

    def get(name: str) -> tuple[list[dict], str]:
        if name not in cache:
            world, layout = LAYOUTS[name]
            ckpt = str(tmp_path_factory.mktemp(f"saved-{name}"))
            cache[name] = (_train(data, world, ckpt, **layout), ckpt)
        return cache[name]
    return get


def _reshard(data: str, saved, tmp_path, src: str, dst: str) -> None:
    """Resume ``src``'s step-4 checkpoint in layout ``dst`` (``workers.check_reshard``)."""
    results, src_ckpt = saved(src)
    world, layout = LAYOUTS[dst]
    check_reshard(lambda ckpt: run_torch_workers("tests.trainer.pp_workers:resume_and_digest", world, timeout=300,
                                                 spec=pp_spec(data, ckpt, **layout)),
                  src_ckpt, tmp_path / "ckpt", SAVED_AT, position=SAVED_AT * GLOBAL_BATCH,
                  want_losses=results[0]["losses"][SAVED_AT:],
                  holds={"model/layers.3.attention.wq.weight", "model/output.weight"})


@pytest.mark.parametrize("src,dst", [("pp2", "single"), pytest.param("single", "pp2", marks=pytest.mark.slow),
                                     pytest.param("pp2i", "pp2", marks=pytest.mark.slow),
                                     pytest.param("pp2", "pp2i", marks=pytest.mark.slow)])
def test_reshard_pp2_and_one_rank(data, saved, tmp_path, src, dst):
    _reshard(data, saved, tmp_path, src, dst)


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [(a, b) for a in ("pp2xdp2", "tp2xpp2", "single")
                                     for b in ("pp2xdp2", "tp2xpp2", "single") if a != b])
def test_reshard_matrix(data, saved, tmp_path, src, dst):
    _reshard(data, saved, tmp_path, src, dst)


def test_pp2_nan_step_is_skipped_on_every_stage(data):
    results = _train(data, 2, env={"MARIND_TEST_NAN_AT_STEP": 3}, pp=2, steps=4)
    for res in results:   # rank 0 poisons a first-stage gradient; the last stage skips the step too
        assert res["skipped_steps"] == [3] and len(res["losses"]) == 3 and res["step"] == 4
    assert results[0]["losses"] == results[1]["losses"]

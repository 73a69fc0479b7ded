"""Pipeline keys of the spec: each one-line error, and the stage split (pure: no process)."""

from __future__ import annotations

import pytest

from marind.core.errors import SpecError
from marind.trainer.config import load_trainer_spec, validate_for_world
from marind.trainer.parallel.pipeline_spec import StagePlan, microbatches, stage_plan, stages_per_rank

pytestmark = pytest.mark.unit


def _text(parallel: str = "", model: str = "tie_embeddings = false", extra: str = "", nodes: str = "1:1",
          nproc: int = 2, global_batch: int = 8) -> str:
    pp = "" if any(line.startswith("pp =") for line in parallel.splitlines()) else "pp = 2"
    return f"""
[job]
name = "pp"
nodes = "{nodes}"
nproc_per_node = {nproc}
[model]
preset = "tiny"
n_layers = 4
{model}
[parallel]
{"" if "dp_shard =" in parallel else "dp_shard = -1"}
{pp}
{parallel}
[data]
path = "data/x"
global_batch = {global_batch}
micro_batch = 1
{extra}
"""


def _err(text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_trainer_spec(text)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_a_valid_pipeline_spec_and_its_defaults():
    spec = load_trainer_spec(_text())
    assert spec.parallel.pp == 2 and spec.parallel.pp_schedule == "1F1B"
    assert microbatches(spec) == 2 and stages_per_rank(spec) == 1
    inter = load_trainer_spec(_text('pp_schedule = "Interleaved1F1B"\npp_microbatches = 4'))
    assert stages_per_rank(inter) == 2 and stage_plan(inter).stages == 4
    assert validate_for_world(spec, 4) == (1, 2, 1)   # world 4 = dp_shard 2 x pp 2


@pytest.mark.parametrize("parallel,model,needle", [
    ("pp = 0", "tie_embeddings = false", "parallel.pp must be >= 1"),
    ('pp_schedule = "1f1b"', "tie_embeddings = false", "parallel.pp_schedule = '1f1b': use one of 1F1B"),
    ("pp = 3", "tie_embeddings = false", "parallel.pp = 3 must divide model.n_layers = 4"),
    ('pp_schedule = "Interleaved1F1B"\npp_stages_per_rank = 3', "tie_embeddings = false",
     "parallel.pp x pp_stages_per_rank = 2x3 = 6 must divide model.n_layers = 4"),
    ('pp_schedule = "Interleaved1F1B"\npp_stages_per_rank = 1', "tie_embeddings = false",
     "needs parallel.pp_stages_per_rank >= 2"),
    ("pp_stages_per_rank = 2", "tie_embeddings = false", "needs parallel.pp_schedule = \"Interleaved1F1B\""),
    ("pp_microbatches = 1", "tie_embeddings = false", "parallel.pp_microbatches = 1 must be >= parallel.pp = 2"),
    ("pp_microbatches = -1", "tie_embeddings = false", "parallel.pp_microbatches must be >= 1"),
    ('pp_schedule = "Interleaved1F1B"\npp_microbatches = 3', "tie_embeddings = false",
     "must be a multiple of parallel.pp = 2 for Interleaved1F1B"),
    ("", "", "model.tie_embeddings = true cannot be split across pipeline stages"),
    ("", 'tie_embeddings = false\ninit_from = "/nowhere"', "model.init_from does not load into pipeline stages"),
])
def test_each_pipeline_error(parallel, model, needle):
    assert needle in _err(_text(parallel, model))


def test_moe_through_pipeline_stages():
    moe = "tie_embeddings = false\nn_experts = 4\ntop_k = 2"
    assert load_trainer_spec(_text(model=moe)).model.n_experts == 4
    spec = load_trainer_spec(_text("ep = 2", moe, nproc=4))          # world 4 = pp 2 x dp_shard 2, ep 2
    assert validate_for_world(spec, 4) == (1, 2, 1)
    # ep borrows from a stage's dp_shard: world 2 / pp 2 leaves dp_shard = 1
    assert "parallel.ep = 2 must divide parallel.dp_shard = 1" in _err(_text("ep = 2", moe, nproc=2))
    # moe_every = 4 leaves stage 0 (layers 0-1) without experts: refused only with ep > 1
    assert load_trainer_spec(_text(model=moe + "\nmoe_every = 4", nproc=4)).model.moe_every == 4
    msg = _err(_text("ep = 2", moe + "\nmoe_every = 4", nproc=4))
    assert "pipeline stage 0 (layers 0-1) holds no MoE block (model.moe_every = 4)" in msg


def test_pipeline_under_torchft_is_refused():
    text = _text(extra='[fault]\nmode = "torchft"\nnodes_per_group = 1', nodes="2:2", nproc=2)
    assert "does not run under fault.mode = \"torchft\"" in _err(text)


def test_the_world_must_be_a_multiple_of_pp():
    assert "parallel.pp = 2 does not divide the world size 3" in _err(_text(nproc=3))


def test_the_stage_mesh_must_fit_world_over_pp():
    msg = _err(_text("dp_shard = 2\ntp = 2", nproc=4))
    assert "does not match the world size 4 / parallel.pp = 2 = 2" in msg


def test_the_per_rank_batch_must_divide_into_microbatches():
    # world 4 = pp 2 x dp 2: 8 / 2 = 4 samples per rank, not 3 micro-batches
    msg = _err(_text("pp_microbatches = 3", nproc=4))
    assert "does not divide into parallel.pp_microbatches = 3" in msg


@pytest.mark.parametrize("pp,per_rank,n_layers", [(2, 1, 4), (2, 2, 8), (4, 1, 4), (3, 2, 12)])
def test_stage_plan_covers_every_layer_once(pp, per_rank, n_layers):
    plan = StagePlan(pp, per_rank, n_layers)
    seen = []
    for r in range(pp):
        stages = plan.rank_stages(r)
        assert len(stages) == per_rank and stages[0] == r
        for s in stages:
            seen.extend(plan.stage_layers(s))
    assert sorted(seen) == list(range(n_layers))
    assert plan.stage_layers(0)[0] == 0 and plan.stage_layers(plan.stages - 1)[-1] == n_layers - 1

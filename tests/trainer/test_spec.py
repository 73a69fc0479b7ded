"""run.toml loader: parsing, round trip, and one-line errors naming the key (pure)."""

from __future__ import annotations

import json

import pytest

from marind.core.errors import SpecError
from marind.core.spec import parse_duration, parse_nodes
from marind.trainer.config import TrainerSpec, grad_accum_steps, resolve_mesh, validate_for_world
from marind.trainer.config import load_trainer_spec as load_spec

pytestmark = pytest.mark.unit  # parsing only: no process, no server

BASE = """
[job]
name = "gpt-tiny"
nodes = "1:2"
nproc_per_node = 2
max_restarts = 20
hang_timeout = "120s"
entrypoint = "marind.trainer"

[model]
preset = "tiny"

[parallel]
dp_replicate = 1
dp_shard = -1
tp = 1

[data]
path = "data/shakespeare"
seq_len = 256
global_batch = 32
micro_batch = 4

[optim]
lr = 3e-4
warmup_steps = 20
grad_clip = 1.0

[train]
steps = 200
seed = 1234

[checkpoint]
url = "file:///var/lib/marind/ckpt"
every_steps = 20
async = true
keep_last = 3
"""


def _err(text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(text)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_design_example_parses():
    spec = load_spec(BASE)
    assert spec.job.nodes == (1, 2) and spec.job.hang_timeout == 120.0
    assert spec.model.n_heads == 4 and spec.model.dim == 64
    assert spec.checkpoint.async_ is True
    assert spec.world_sizes() == [2, 4]


def test_round_trip_json(tmp_path):
    spec = load_spec(BASE)
    again = TrainerSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    path = tmp_path / "run.toml"
    path.write_text(BASE)
    from_file = load_spec(path)          # relative paths resolve against the file's directory
    assert from_file == load_spec(str(path)) and from_file.job.working_dir == str(tmp_path.resolve())
    assert from_file.data.path == str(tmp_path.resolve() / "data/shakespeare")
    assert from_file.replace(job=spec.job, data=spec.data) == spec


def test_preset_override():
    spec = load_spec(BASE.replace('preset = "tiny"', 'preset = "1.3b"\nn_layers = 2'))
    assert (spec.model.dim, spec.model.n_layers, spec.model.n_heads) == (2048, 2, 16)


@pytest.mark.parametrize("value,seconds", [("120s", 120), ("5m", 300), ("1h", 3600), ("250ms", 0.25), (7, 7)])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


def test_bad_duration():
    assert "job.hang_timeout" in _err(BASE.replace('"120s"', '"2 minutes"'))


def test_nodes():
    assert parse_nodes("2") == (2, 2) and parse_nodes(3) == (3, 3)
    for bad in ("2:1", "a:b", "1:2:3", "0"):
        with pytest.raises(SpecError, match="job.nodes"):
            parse_nodes(bad)


def test_syntax_error_has_line():
    msg = _err(BASE.replace("steps = 200", "steps = = 200"))
    assert "line" in msg and "TOML" in msg


def test_unknown_key_did_you_mean():
    msg = _err(BASE.replace("global_batch", "global_bach"))
    assert "data.global_bach" in msg and "global_batch" in msg
    assert "did you mean 'checkpoint'" in _err(BASE.replace("[checkpoint]", "[checkpont]"))


def test_wrong_type():
    assert "train.steps must be an integer" in _err(BASE.replace("steps = 200", 'steps = "200"'))
    assert "checkpoint.async must be true or false" in _err(BASE.replace("async = true", "async = 1"))


def test_keep_every_keeps_checkpoints_for_good():
    assert load_spec(BASE).checkpoint.keep_every == 0    # off unless asked for
    spec = load_spec(BASE.replace("keep_last = 3", "keep_last = 3\nkeep_every = 1000"))
    assert spec.checkpoint.keep_every == 1000
    assert "checkpoint.keep_every" in _err(BASE.replace("keep_last = 3", "keep_last = 3\nkeep_every = -5"))


def test_tp_must_divide_heads():
    msg = _err(BASE.replace("tp = 1", "tp = 3"))
    assert "parallel.tp" in msg and "n_heads" in msg


def test_global_batch_divisibility_over_node_range():
    # world 2 -> dp 2 ok for 12/(2x2)=3, world 4 -> 4x2=8 does not divide 12
    msg = _err(BASE.replace("global_batch = 32", "global_batch = 12").replace("micro_batch = 4", "micro_batch = 2"))
    assert "data.global_batch" in msg and "2 node(s)" in msg


def test_fixed_mesh_must_match_every_world():
    msg = _err(BASE.replace("dp_shard = -1", "dp_shard = 2"))
    assert "world size 4" in msg and "dp_shard = -1" in msg


def test_resolve_mesh_and_accum():
    spec = load_spec(BASE.replace("tp = 1", "tp = 2"), check_worlds=False)
    assert resolve_mesh(spec, 4) == (1, 2, 2)
    assert validate_for_world(spec, 8) == (1, 4, 2)
    assert grad_accum_steps(spec, 4) == 2
    with pytest.raises(SpecError, match="world size 3"):
        resolve_mesh(spec, 3)


def test_data_path_required():
    assert "data.path" in _err(BASE.replace('path = "data/shakespeare"', ""))


def test_unknown_preset():
    assert "did you mean '125m'" in _err(BASE.replace('preset = "tiny"', 'preset = "125M"'))


def test_dp_replicate_fills_for_hsdp():
    spec = load_spec(BASE.replace("dp_replicate = 1", "dp_replicate = -1").replace("dp_shard = -1", "dp_shard = 2"),
                     check_worlds=False)
    assert resolve_mesh(spec, 8) == (4, 2, 1)
    assert "both -1" in _err(BASE.replace("dp_replicate = 1", "dp_replicate = -1"))


@pytest.mark.parametrize("name", ["tiny.toml", "moe-tiny.toml", "gpt-125m.toml", "gpt-1.3b.toml"])
def test_examples_validate(name):
    from pathlib import Path
    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / name)
    for world in spec.world_sizes():
        validate_for_world(spec, world)


def test_prepare_timeout_bounds_an_async_save_s_storage_check_under_an_agent():
    from marind.trainer.checkpointing import _prepare_bound
    assert load_spec(BASE).checkpoint.prepare_timeout == 2.0
    spec = load_spec(BASE.replace("keep_last = 3", 'keep_last = 3\nprepare_timeout = "15s"'))
    assert spec.checkpoint.prepare_timeout == 15.0
    assert "checkpoint.prepare_timeout" in _err(BASE.replace("keep_last = 3", 'keep_last = 3\nprepare_timeout = -1'))
    assert _prepare_bound(15.0, "/run") == 15.0
    assert _prepare_bound(0.0, "/run") is None       # 0 = unbounded
    assert _prepare_bound(2.0, None) is None         # not under an agent: the caller waits

"""A TorchX AppDef as a marind run spec, and the scheduler's state mapping: pure functions, no server.

The AppDefs come from TorchX's own components (``dist.ddp``, ``dist.torchrun``, ``utils.sh``) as
``torchx run`` builds them; the torchrun option table is checked against torch's own parser.
"""

from __future__ import annotations

import argparse
import warnings

import pytest
from torchx.components import dist, utils
from torchx.runner import get_runner
from torchx.schedulers import get_scheduler_factories
from torchx.specs import AppDef, AppState, BindMount, Resource, Role, is_terminal

from marind.control.lifecycle import JobState
from marind.core.errors import SpecError
from marind.core.spec import RunSpec
from marind.integrations.torchx_scheduler import APP_STATE, MarindScheduler, app_state
from marind.integrations.torchx_spec import app_to_request, parse_torchrun, torchrun_options

pytestmark = pytest.mark.unit


def _ddp(**kw) -> AppDef:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # dist.ddp is a deprecated alias of dist.torchrun
        return dist.ddp(**kw)


def test_ddp_2x2_becomes_two_nodes_of_two_ranks_running_the_script(tmp_path):
    app = _ddp(script="train.py", j="2x2", env={"FOO": "bar"})
    app.roles[0].args[-1] += " --lr 3e-4"
    req = app_to_request(app, job_id="train-1", working_dir=str(tmp_path))
    job = req.spec["job"]
    assert job["command"] == ["python", "train.py", "--lr", "3e-4"]
    assert job["nodes"] == "2:2" and job["nproc_per_node"] == 2
    assert job["working_dir"] == str(tmp_path) and job["name"] == "train" and req.job_id == "train-1"
    assert job["env"]["FOO"] == "bar"
    assert job["max_restarts"] == 3                       # dist.ddp's max_retries=0 means "not asked"
    assert "torchrun --rdzv-backend" in req.ignored and "torchrun --rdzv-endpoint" in req.ignored
    RunSpec.from_dict(req.spec)                           # what the agents read back


def test_elastic_range_module_and_retries_map(tmp_path):
    app = dist.torchrun("--epochs", "2", m="pkg.train", j="1:3x4", max_retries=7)
    req = app_to_request(app, working_dir=str(tmp_path))
    job = req.spec["job"]
    assert job["command"] == ["python", "-m", "pkg.train", "--epochs", "2"]
    assert job["nodes"] == "1:3" and job["nproc_per_node"] == 4 and job["max_restarts"] == 7
    assert req.job_id.startswith("train-")
    over = app_to_request(app, working_dir=str(tmp_path), max_restarts=1, hang_timeout="90s").spec["job"]
    assert over["max_restarts"] == 1 and over["hang_timeout"] == 90.0


def test_plain_role_runs_its_entrypoint_one_rank_per_gpu_and_app_id_macro(tmp_path):
    role = Role(name="echo", image="x", entrypoint="python", args=["job.py", "--id", "${app_id}"],
                num_replicas=2, resource=Resource(cpu=1, gpu=4, memMB=100))
    req = app_to_request(AppDef(name="echo", roles=[role]), job_id="echo-7", working_dir=str(tmp_path))
    job = req.spec["job"]
    assert job["command"] == ["python", "job.py", "--id", "echo-7"]
    assert job["nproc_per_node"] == 4 and job["nodes"] == "2:2"
    shell = app_to_request(utils.sh("echo", "node", "${replica_id}"), working_dir=str(tmp_path)).spec["job"]
    assert shell["command"][0] == "sh" and "$GROUP_RANK" in shell["command"][-1]


def test_base_run_toml_supplies_what_an_appdef_cannot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                           # the working dir: where `torchx run` runs
    base = tmp_path / "base.toml"
    base.write_text('[job]\nhang_timeout = "45s"\nentrypoint = "x.y"\nenv = { A = "1" }\n'
                    '[checkpoint]\nurl = "ckpt"\n[mine]\nlr = 0.5\n')
    req = app_to_request(_ddp(script="train.py", j="1x1"), run_toml=str(base))
    assert req.spec["job"]["hang_timeout"] == 45.0 and req.spec["job"]["command"][1] == "train.py"
    assert req.spec["job"]["env"]["A"] == "1" and req.spec["mine"] == {"lr": 0.5}
    assert req.spec["checkpoint"]["url"] == str(tmp_path / "ckpt")      # relative to the working dir


@pytest.mark.parametrize("make, needle", [
    (lambda: AppDef("two", roles=[Role("a", "i", entrypoint="x"), Role("b", "i", entrypoint="y")]),
     "has roles [a, b]: a marind job is one role"),
    (lambda: AppDef("m", roles=[Role("a", "i", entrypoint="x", mounts=[BindMount("/a", "/b")])]),
     "mounts are not supported"),
    (lambda: AppDef("sh", roles=[Role("a", "i", entrypoint="bash", args=["-c", "torchrun x.py && rm -rf y"])]),
     "runs more than torchrun (&&)"),
    (lambda: AppDef("u", roles=[Role("a", "i", entrypoint="torchrun", args=["--bogus", "1", "x.py"])]),
     "torchrun option --bogus is not one torchrun has"),
    (lambda: AppDef("n", roles=[Role("a", "i", entrypoint="torchrun", args=["--numa-binding", "node", "x.py"])]),
     "--numa-binding cannot map"),
    (lambda: AppDef("g", roles=[Role("a", "i", entrypoint="torchrun", args=["--nproc-per-node", "4", "x.py"],
                                     resource=Resource(cpu=1, gpu=2, memMB=1))]),
     "4 processes per node but the role's resource has 2 GPU(s)"),
    (lambda: AppDef("a", roles=[Role("a", "i", entrypoint="torchrun", args=["--nproc-per-node", "auto", "x.py"])]),
     "marind needs a number"),
    (lambda: AppDef("r", roles=[Role("a", "i", entrypoint="python", args=["x.py", "${replica_id}"])]),
     "use ${replica_id}"),
    (lambda: AppDef("d", roles=[Role("a", "i", entrypoint="bash", args=["-c", "torchrun x.py --out $HOME/o"])]),
     "need a shell to expand"),
    (lambda: AppDef("k", roles=[Role("a", "i", entrypoint="torchrun", args=["--nnodes", "3", "x.py"],
                                     num_replicas=2)]),
     "disagrees with the role's replicas 2:2"),
])
def test_what_cannot_map_is_one_line_naming_the_fix(tmp_path, make, needle):
    with pytest.raises(SpecError) as err:
        app_to_request(make(), working_dir=str(tmp_path))
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg


def test_missing_working_dir_is_refused(tmp_path):
    with pytest.raises(SpecError, match="is not a directory"):
        app_to_request(_ddp(script="t.py", j="1x1"), working_dir=str(tmp_path / "nope"))


def test_torchrun_option_table_is_torchs():
    from torch.distributed.run import get_args_parser
    ours = torchrun_options()
    for action in get_args_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        takes_value = action.nargs != 0
        for opt in action.option_strings:
            assert ours.get(opt) == (action.dest, takes_value), opt
    assert set(ours) == {o for a in get_args_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    call = parse_torchrun(["-t3", "--nnodes=1:2", "--standalone", "x.py", "--nnodes", "9"])
    assert call.options == {"tee": "3", "nnodes": "1:2", "standalone": True}
    assert call.program == ["x.py", "--nnodes", "9"]


def test_every_marind_state_maps_to_an_app_state():
    assert set(APP_STATE) == set(JobState)
    for state in JobState:
        mapped = app_state(state.value)
        assert mapped != AppState.UNKNOWN
        assert is_terminal(mapped) == state.is_terminal(), state
    assert app_state("RESTARTING") == AppState.RUNNING and app_state("PENDING") == AppState.PENDING
    assert app_state("SOMETHING_NEW") == AppState.UNKNOWN


@pytest.mark.filterwarnings("ignore:.*dist.ddp is deprecated")
def test_scheduler_is_registered_through_the_entry_point(tmp_path, monkeypatch):
    assert "marind" in get_scheduler_factories()
    monkeypatch.chdir(tmp_path)
    with get_runner() as runner:
        info = runner.dryrun_component("dist.ddp", ["-j", "2x1", "--script", "train.py"], "marind",
                                       cfg={"etcd": ["http://127.0.0.1:1"], "max_restarts": 4})
        assert isinstance(runner._scheduler("marind"), MarindScheduler)
    job = info.request.request.spec["job"]
    assert job["nodes"] == "2:2" and job["max_restarts"] == 4 and job["working_dir"] == str(tmp_path)
    assert job["env"]["TORCHX_JOB_ID"].endswith(f"/{info.request.request.job_id}")     # ${app_id} is the job id
    assert '"id"' in str(info)

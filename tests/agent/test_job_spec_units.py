"""The job spec for any program (pure): entrypoint or command, working dir, relative paths,
a program's own sections, the launcher's warm-start decision, and submit's refusals."""

from __future__ import annotations

import sys
import tomllib

import pytest

from marind.agent.torchrun_args import spec_to_toml, warm_start_applies
from marind.agent.warm_start.zygote import preload_names
from marind.agent.warm_start.zygote_stub import cold_argv, python_target
from marind.cli import main
from marind.core.errors import SpecError
from marind.core.netutil import free_port
from marind.core.spec import TRAINER_ENTRYPOINT, RunSpec, load_spec, missing_paths, resolve_paths
from marind.trainer.config import trainer_spec

pytestmark = pytest.mark.unit

PROGRAM = """
[job]
name = "ddp"
nproc_per_node = 3
command = ["python", "train.py", "--lr", "3e-4"]
[checkpoint]
url = "ckpt"
[data]
path = "nowhere"
global_batch = 32
[mine]
layers = [{ width = 8 }, { width = 4 }]
"key with spaces" = 1.5
[mine.sub]
on = true
"""


def _err(text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(text)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_program_job_keeps_its_own_sections_untouched():
    spec = load_spec(PROGRAM)
    assert spec.job.command == ("python", "train.py", "--lr", "3e-4") and spec.job.entrypoint == ""
    assert not spec.runs_trainer
    assert spec.section("data") == {"path": "nowhere", "global_batch": 32}   # nproc 3: no batch arithmetic
    assert spec.section("mine")["layers"] == [{"width": 8}, {"width": 4}] and spec.target_steps is None
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert "entrypoint" not in spec.to_dict()["job"]


def test_the_stored_run_toml_round_trips_a_programs_sections():
    spec = load_spec(PROGRAM)
    text = spec_to_toml(spec.to_dict())
    assert tomllib.loads(text)["mine"] == spec.section("mine") and load_spec(text) == spec


def test_entrypoint_or_command_never_both():
    assert "both entrypoint and command" in _err(PROGRAM.replace("[checkpoint]", 'entrypoint = "x.y"\n[checkpoint]'))
    assert "job.command is empty" in _err(PROGRAM.replace('["python", "train.py", "--lr", "3e-4"]', "[]"))
    assert "job.command must be an array of strings" in _err(PROGRAM.replace('"--lr", "3e-4"', "3"))
    assert "empty string" in _err(PROGRAM.replace('"train.py"', '""'))
    msg = _err('[job]\nentrypoint = "train.py"\n')
    assert "python module name" in msg and 'command = ["python", \'train.py\']' in msg
    assert "job.entrypoint is empty" in _err('[job]\nentrypoint = ""\n')
    assert load_spec("[job]\nname = 'x'\n").job.entrypoint == TRAINER_ENTRYPOINT      # neither: the trainer
    assert load_spec('[job]\nentrypoint = "trainer"\n').runs_trainer                  # the old name
    assert "job.preload" in _err('[job]\npreload = ["ok.mod", "not a module"]\n')


def test_a_date_in_a_programs_section_is_refused():
    assert "mine.when" in _err("[mine]\nwhen = 2024-01-01\n")


def test_relative_paths_resolve_against_the_working_dir(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "run.toml"
    path.write_text(PROGRAM)
    spec = load_spec(path)                           # working dir: the file's directory
    assert spec.job.working_dir == str(tmp_path / "conf")
    assert spec.checkpoint.url == str(tmp_path / "conf" / "ckpt")
    assert spec.section("data")["path"] == "nowhere"  # a program's own paths are its own (cwd = working dir)
    path.write_text(PROGRAM.replace("[checkpoint]", 'working_dir = ".."\n[checkpoint]'))
    spec = load_spec(path)
    assert spec.job.working_dir == str(tmp_path) and spec.checkpoint.url == str(tmp_path / "ckpt")
    for url in ("s3://b/p", "file:///abs/c", "/abs/c", ""):
        text = PROGRAM.replace('url = "ckpt"', f'url = "{url}"')
        assert resolve_paths(load_spec(text), tmp_path).checkpoint.url == url
    assert missing_paths(spec) is None
    gone = resolve_paths(load_spec(PROGRAM.replace("[checkpoint]", 'working_dir = "gone"\n[checkpoint]')), tmp_path)
    assert "job.working_dir" in (missing_paths(gone) or "") and str(tmp_path / "gone") in (missing_paths(gone) or "")


def test_the_trainers_sections_are_checked_only_for_the_trainer(tmp_path):
    trainer = PROGRAM.replace('command = ["python", "train.py", "--lr", "3e-4"]', "").replace("[mine]", "[mine0]")
    with pytest.raises(SpecError, match=r"unknown section \[mine0\]"):
        trainer_spec(load_spec(trainer))
    trainer = trainer[:trainer.index("[mine0]")]
    with pytest.raises(SpecError, match="data.global_batch = 32 is not divisible"):   # 3 ranks
        trainer_spec(load_spec(trainer))
    path = tmp_path / "run.toml"
    path.write_text(trainer.replace("nproc_per_node = 3", "nproc_per_node = 2"))
    typed = trainer_spec(load_spec(path))
    assert typed.data.path == str(tmp_path / "nowhere") and typed.job.preload     # the trainer's preload list
    core = typed.core()
    assert core.target_steps == typed.train.steps and trainer_spec(RunSpec.from_dict(core.to_dict())) == typed


@pytest.mark.parametrize("command,target", [
    (["python", "train.py", "--lr", "1"], ("script", "train.py", ["--lr", "1"])),
    (["python3", "-u", "t.py"], ("script", "t.py", [])),
    (["python", "-m", "pkg.train", "x"], ("module", "pkg.train", ["x"])),
    ([sys.executable, "t.py"], ("script", "t.py", [])),
    (["python", "-X", "dev", "t.py"], None),
    (["python", "-c", "print(1)"], None),
    (["python"], None),
    (["/opt/other/bin/python", "t.py"], None),
    (["bash", "run.sh"], None),
])
def test_which_commands_the_zygote_may_run(command, target):
    got, why = python_target(command, sys.executable)
    assert got == target and why


def test_a_cold_command_runs_the_launchers_python():
    assert cold_argv(["python", "t.py"], "/venv/bin/python") == ["/venv/bin/python", "t.py"]
    assert cold_argv(["bash", "-c", "x"], "/venv/bin/python") == ["bash", "-c", "x"]


def test_warm_start_and_preload_decisions():
    spec = load_spec(PROGRAM)
    assert warm_start_applies(spec.job)
    assert not warm_start_applies(load_spec(PROGRAM.replace('"python", "train.py"', '"bash", "run.sh"')).job)
    assert not warm_start_applies(load_spec(PROGRAM.replace("[checkpoint]", "warm_start = false\n[checkpoint]")).job)
    assert preload_names("") == ["torch", "torch.distributed"]
    assert preload_names("a.b, torch ,c") == ["torch", "torch.distributed", "a.b", "c"]


def test_submit_refuses_a_missing_data_path_or_working_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", f"http://127.0.0.1:{free_port()}")   # nothing may reach it (exit 3)
    monkeypatch.delenv("MARIND_DEBUG", raising=False)
    path = tmp_path / "run.toml"
    path.write_text('[job]\nname = "t"\n[data]\npath = "data/none"\n')
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"dataset {tmp_path}/data/none.idx does not exist" in err, err
    path.write_text(PROGRAM.replace("[checkpoint]", 'working_dir = "no/such/dir"\n[checkpoint]'))
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"job.working_dir {tmp_path}/no/such/dir is not a directory" in err, err
    path.write_text(PROGRAM)                         # a program's [data] path is its own: not checked
    assert main(["submit", str(path)]) == 3          # valid: it got as far as etcd

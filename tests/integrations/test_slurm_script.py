"""examples/slurm/marind.sbatch and `marind slurm-script`, without Slurm: the script's own checks.

The script is shellcheck-clean (Debian's ``shellcheck``, which ``make setup`` installs; the test
skips, saying so, where it is absent), refuses to run outside a Slurm job with one line and exit 2,
and refuses bad settings the same way before it starts anything. ``marind slurm-script`` writes the
same script with a run.toml's name, node range and path filled in. The script under a real Slurm:
tests/chaos/test_host_slurm.py.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from marind.cli import main
from marind.integrations.slurm import render_sbatch, script_text
from tests.agent.helpers import tiny_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "slurm" / "marind.sbatch"
MARIND_BIN = str(Path(sys.executable).with_name("marind"))


def _run(script: Path, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MARIND_"))}
    return subprocess.run(["bash", str(script), *args], env={**base, **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def _shellcheck(path: Path) -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; `make setup` installs it)")
    res = subprocess.run([exe, "--shell=bash", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_example_is_the_shipped_script():
    assert EXAMPLE.read_text() == script_text(), \
        "examples/slurm/marind.sbatch is a link to marind/integrations/marind.sbatch"
    assert EXAMPLE.stat().st_mode & stat.S_IXUSR


def test_the_script_is_shellcheck_clean(tmp_path):
    _shellcheck(EXAMPLE)
    rendered = tmp_path / "run.sbatch"
    rendered.write_text(render_sbatch(tiny_spec(tmp_path, nodes="2:4")))
    _shellcheck(rendered)


def test_outside_slurm_it_refuses_with_one_line_and_exit_2(tmp_path):
    spec = tiny_spec(tmp_path)
    for args in ((str(spec),), ()):
        res = _run(EXAMPLE, *args, env={"MARIND_BIN": MARIND_BIN, "TMPDIR": str(tmp_path)}, cwd=tmp_path)
        assert res.returncode == 2, res
        assert res.stdout == "" and res.stderr.count("\n") == 1, res
        assert res.stderr.startswith("Error: ") and "no SLURM_JOB_ID" in res.stderr and "sbatch" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.name]        # nothing started, nothing written


@pytest.mark.parametrize("case", ["no_run_toml", "missing_run_toml", "no_marind", "bad_min", "min_above_alloc",
                                  "bad_etcd_mode", "bad_requeue"])
def test_inside_a_job_bad_settings_exit_2_before_anything_starts(tmp_path, case):
    """What a job would fail on later is refused at once, one line, exit 2, nothing started or written."""
    spec = str(tiny_spec(tmp_path))
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "3", "MARIND_BIN": MARIND_BIN,
           "MARIND_SLURM_STATE_DIR": str(tmp_path / "state"), "PATH": os.environ.get("PATH", "")}
    args: tuple[str, ...] = (spec,)
    if case == "no_run_toml":
        args = ()
    elif case == "missing_run_toml":
        args = (str(tmp_path / "nope.toml"),)
    elif case == "no_marind":
        env["MARIND_BIN"] = str(tmp_path / "no-such-marind")
    elif case == "bad_min":
        env["MARIND_SLURM_MIN_NODES"] = "two"
    elif case == "min_above_alloc":
        env["MARIND_SLURM_MIN_NODES"] = "4"
    elif case == "bad_etcd_mode":
        env["MARIND_SLURM_ETCD"] = "cloud"
    elif case == "bad_requeue":
        env["MARIND_SLURM_REQUEUE"] = "sometimes"
    res = _run(EXAMPLE, *args, env=env)
    assert res.returncode == 2, res
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res
    assert not (tmp_path / "state").exists()


def test_slurm_script_fills_in_the_run(tmp_path, capsys):
    spec = tiny_spec(tmp_path, name="llm-7b", nodes="3:8")
    assert main(["slurm-script", str(spec)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "#SBATCH --job-name=llm-7b" in lines and "#SBATCH --nodes=8" in lines
    assert any(line.startswith(f"run_toml_default={spec.resolve()}") for line in lines)
    assert any(line.startswith('min_nodes_default="3"') for line in lines)
    body = [line for line in lines if not line.startswith(("#SBATCH --job-name", "#SBATCH --nodes",
                                                           "run_toml_default=", "min_nodes_default="))]
    generic = [line for line in script_text().splitlines()
               if not line.startswith(("#SBATCH --job-name", "#SBATCH --nodes", "run_toml_default=",
                                       "min_nodes_default="))]
    assert body == generic, "only the four filled lines may differ from the example"
    out = tmp_path / "job.sbatch"
    assert main(["slurm-script", str(spec), "--min-nodes", "5", "-o", str(out)]) == 0
    assert out.stat().st_mode & stat.S_IXUSR and 'min_nodes_default="5"' in out.read_text()
    assert subprocess.run(["bash", "-n", str(out)], timeout=30).returncode == 0


@pytest.mark.parametrize("case", ["missing", "invalid", "min_zero", "min_above_max", "output_dir"])
def test_slurm_script_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    spec = tiny_spec(tmp_path, nodes="1:2")
    argv = ["slurm-script", str(spec)]
    if case == "missing":
        argv = ["slurm-script", str(tmp_path / "nope.toml")]
    elif case == "invalid":
        spec.write_text("[job]\nname = 'x'\nnodez = 2\n")
    elif case == "min_zero":
        argv += ["--min-nodes", "0"]
    elif case == "min_above_max":
        argv += ["--min-nodes", "3"]
    elif case == "output_dir":
        argv += ["-o", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.count("\n") == 1, err

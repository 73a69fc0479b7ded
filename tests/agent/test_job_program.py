"""Any program under a real agent: `[job] command`, `working_dir`, relative paths, preload.

A trainer spec with relative paths, submitted from another directory, trains; a
``command = ["python", "prog.py", ...]`` job (a script without a main guard that
imports nothing of the trainer) runs to SUCCEEDED from its working dir, its top level
run exactly once per worker (never in the zygote); a job whose preload fails still
succeeds, each worker started cold at once with the zygote's reason in the log.
"""

from __future__ import annotations

import json
from pathlib import Path

from marind.cli import main
from tests.agent.helpers import agent_log, node_registered, start_agent, wait_for

# No main guard on purpose: the top level is the program. Imports nothing of the trainer.
PROGRAM = '''
import json, os, sys, tomllib
from pathlib import Path

with open("starts.log", "a") as fh:             # relative: the cwd is [job] working_dir
    fh.write(f"{os.getpid()} {os.environ['RANK']} {os.getcwd()}\\n")

import torch
import torch.distributed as dist

cfg = tomllib.loads(Path(os.environ["MARIND_RUN_TOML"]).read_text())["tiny"]   # the program's own section
dist.init_process_group("gloo")
total = torch.zeros(1)
for step in range(cfg["steps"]):
    x = torch.ones(1)
    dist.all_reduce(x)
    total += x
if dist.get_rank() == 0:
    Path(cfg["out"]).write_text(json.dumps({"total": total.item(), "argv": sys.argv[1:],
                                            "layers": cfg["model"]["layers"]}))
dist.destroy_process_group()
'''


def _program_dir(root: Path, name: str, extra_job: str = "") -> Path:
    proj = root / name
    proj.mkdir()
    (proj / "prog.py").write_text(PROGRAM)
    (proj / "run.toml").write_text(f"""
[job]
name = "{name}"
nodes = "1"
nproc_per_node = 2
max_restarts = 0
command = ["python", "prog.py", "--lr", "3e-4"]
{extra_job}
[tiny]
steps = 3
out = "result.json"
[tiny.model]
layers = [{{ width = 8 }}, {{ width = 4 }}]
[data]                      # not the trainer's: passed through, never checked
path = "no/such/data"
global_batch = 7
""")
    return proj


def _submit_wait(spec: Path, capsys, tmp_path: Path, node: str) -> str:
    rc = main(["submit", str(spec), "--wait"])
    out = capsys.readouterr().out
    assert rc == 0, f"{out}\n{agent_log(tmp_path, node)}"
    return out.strip().splitlines()[-1]


def _torchrun_log(tmp_path: Path, node: str, job: str) -> str:
    return (tmp_path / f"state-{node}" / "jobs" / job / "logs" / "torchrun.log").read_text(errors="replace")


def test_command_jobs_run_any_program_warm_or_cold(tmp_path, etcd, etcd_client, etcd_prefix, capsys,
                                                   monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    start_agent(tmp_path, "p", etcd.endpoint, etcd_prefix)
    wait_for(lambda: node_registered(etcd_client, "p"), 30, "node p registered", diag=lambda: agent_log(tmp_path, "p"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                     # submitted from another directory

    warm = _program_dir(tmp_path, "warm")
    job = _submit_wait(Path("..") / "warm" / "run.toml", capsys, tmp_path, "p")
    result = json.loads((warm / "result.json").read_text())
    assert result == {"total": 6.0, "argv": ["--lr", "3e-4"], "layers": [{"width": 8}, {"width": 4}]}
    starts = (warm / "starts.log").read_text().splitlines()
    assert len(starts) == 2, f"one top-level run per worker start, none in the zygote: {starts}"
    assert sorted(s.split()[1] for s in starts) == ["0", "1"] and all(s.endswith(str(warm)) for s in starts)
    log = _torchrun_log(tmp_path, "p", job)
    assert "cold start" not in log, log                # both workers were forked by the zygote
    zygote_pids = json.loads((tmp_path / "state-p" / "jobs" / job / "zygote.pids.json").read_text() or "{}")
    assert not zygote_pids, "the zygote reaped both workers"

    # a preload that fails: every worker starts cold at once, told why (not after MARIND_ZYGOTE_WAIT)
    cold = _program_dir(tmp_path, "cold", 'preload = ["no_such_module_xyz"]')
    job = _submit_wait(cold / "run.toml", capsys, tmp_path, "p")
    log = _torchrun_log(tmp_path, "p", job)
    assert log.count("cold start (the zygote could not preload") == 2, log
    assert "no_such_module_xyz" in log and "no zygote at" not in log
    assert len((cold / "starts.log").read_text().splitlines()) == 2
    assert json.loads((cold / "result.json").read_text())["total"] == 6.0


def test_a_trainer_spec_with_relative_paths_trains_from_another_directory(tmp_path, etcd, etcd_client,
                                                                          etcd_prefix, capsys, monkeypatch):
    from marind.trainer.data import corpus
    from marind.trainer.data.dataset import write_dataset
    from marind.trainer.data.tokenize import ByteTokenizer

    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    tok = ByteTokenizer()
    write_dataset(proj / "data" / "corpus", (tok.encode(t) for t in corpus.documents(40)), tok.vocab_size)
    (proj / "conf").mkdir()
    spec = proj / "conf" / "gpt.toml"
    spec.write_text("""
[job]
name = "gpt-rel"
nodes = "1"
nproc_per_node = 2
max_restarts = 1
working_dir = ".."          # relative to this file: proj/
[model]
preset = "tiny"
[data]
path = "data/corpus"        # relative to the working dir
seq_len = 32
global_batch = 4
micro_batch = 1
[train]
steps = 4
[checkpoint]
url = "ckpt"                # a local path, relative to the working dir
every_steps = 2
""")
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    start_agent(tmp_path, "r", etcd.endpoint, etcd_prefix)
    wait_for(lambda: node_registered(etcd_client, "r"), 30, "node r registered", diag=lambda: agent_log(tmp_path, "r"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = _submit_wait(Path("../proj/conf/gpt.toml"), capsys, tmp_path, "r")
    assert main(["status", job, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["jobs"][0]
    assert row["state"] == "SUCCEEDED" and row["step"] == 4
    stored = etcd_client.get_json(etcd_client.key("jobs", job, "spec"))
    assert stored["job"]["working_dir"] == str(proj) and stored["data"]["path"] == str(proj / "data" / "corpus")
    assert stored["checkpoint"]["url"] == str(proj / "ckpt")
    from marind.trainer import MARIND_PRELOAD
    assert stored["job"]["preload"] == list(MARIND_PRELOAD)      # the trainer's list, filled at submit
    assert "cold start" not in _torchrun_log(tmp_path, "r", job)
    assert any((proj / "ckpt").iterdir()), "checkpoints land under the working dir, not the run dir"
    assert not (elsewhere / "ckpt").exists()

"""The real reference trainer under one agent: `marind submit --wait` to SUCCEEDED."""

from __future__ import annotations

import json

from marind.cli import main
from marind.trainer.data import corpus
from marind.trainer.data.dataset import write_dataset
from marind.trainer.data.tokenize import ByteTokenizer
from tests.agent.helpers import agent_log, node_registered, start_agent, wait_for


def test_trainer_job_under_the_agent(tmp_path, etcd, etcd_client, etcd_prefix, capsys, monkeypatch):
    data = tmp_path / "data" / "corpus"
    data.parent.mkdir()
    tok = ByteTokenizer()
    write_dataset(data, (tok.encode(t) for t in corpus.documents(40)), tok.vocab_size)
    spec = tmp_path / "gpt.toml"
    spec.write_text(f"""
[job]
name = "gpt-tiny"
nodes = "1"
nproc_per_node = 2
max_restarts = 2
hang_timeout = "120s"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 1
[train]
steps = 6
[checkpoint]
url = "file://{tmp_path / 'ckpt'}"
every_steps = 3
async = true
""")
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    start_agent(tmp_path, "t", etcd.endpoint, etcd_prefix)
    wait_for(lambda: node_registered(etcd_client, "t"), 30, "node t registered",
             diag=lambda: agent_log(tmp_path, "t"))
    rc = main(["submit", str(spec), "--wait"])
    out = capsys.readouterr().out
    assert rc == 0, f"{out}\n{agent_log(tmp_path, 't')}"
    job = out.strip().splitlines()[-1]
    assert main(["status", job, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["jobs"][0]
    assert row["state"] == "SUCCEEDED" and row["step"] == 6 and row["world_size"] == 2
    assert row["last_checkpoint_step"] in (3, 6) and row["loss"] is not None

    # a job whose entrypoint fails, restarts exhausted: FAILED, and `submit --wait` exits 4
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace('max_restarts = 2', 'max_restarts = 0')
                   .replace('[model]', 'entrypoint = "tests.agent.no_such_module"\n[model]'))
    rc = main(["submit", str(bad), "--wait"])
    cap = capsys.readouterr()
    assert rc == 4 and "FAILED" in cap.err and cap.err.count("\n") == 1, cap.err

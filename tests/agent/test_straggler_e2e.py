"""A straggler under real agents: the reference trainer on two nodes (one rank each, synchronous),
node b's rank slowed on purpose (``MARIND_TEST_COMPUTE_SLEEP`` in its agent's environment, a chaos
hook inside the step's compute); within a minute of the job stepping the agents name b's rank in
a ``straggler`` event, ``{p}/jobs/{job}/stragglers`` and ``marind status``, and a's rank never.

Slow (two agents and a two-node trainer job on a loaded CPU): ``make chaos`` / MARIND_FULL=1; CI
covers the decision and the watch against a real etcd (``test_stragglers.py``).
"""

from __future__ import annotations

import json
import time

import pytest

from marind.cli import main
from marind.trainer.data import corpus
from marind.trainer.data.dataset import write_dataset
from marind.trainer.data.tokenize import ByteTokenizer
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLEEP_S = 1.0          # node b's extra compute per step: about twice a tiny step on this loaded CPU


def test_a_slowed_rank_is_named_within_a_minute(tmp_path, etcd, etcd_client, etcd_prefix, capsys, monkeypatch):
    data = tmp_path / "data" / "corpus"
    data.parent.mkdir()
    tok = ByteTokenizer()
    write_dataset(data, (tok.encode(t) for t in corpus.documents(40)), tok.vocab_size)
    spec = tmp_path / "strag.toml"
    spec.write_text(f"""
[job]
name = "strag"
nodes = "2"
nproc_per_node = 1
max_restarts = 2
hang_timeout = "120s"
[job.env]
OMP_NUM_THREADS = "1"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 2
[train]
steps = 100000
log_every = 50
[checkpoint]
url = ""
[fault]
straggler_factor = 1.5
straggler_window = "10s"
""")
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix, slots=1)
    start_agent(tmp_path, "b", etcd.endpoint, etcd_prefix, slots=1, env={"MARIND_TEST_COMPUTE_SLEEP": str(SLEEP_S)})
    diag = lambda: f"--- a ---\n{agent_log(tmp_path, 'a')}\n--- b ---\n{agent_log(tmp_path, 'b')}"
    wait_for(lambda: node_registered(etcd_client, "a") and node_registered(etcd_client, "b"), 30,
             "both nodes registered", diag=diag)
    assert main(["submit", str(spec)]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]
    try:
        wait_for(lambda: (etcd_client.get_json(etcd_client.key("jobs", job, "progress")) or {}).get("step", 0) >= 3,
                 420, "the job stepping on two nodes", diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
        stepping_at = time.monotonic()
        named = wait_for(lambda: [e for e in etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/")
                                  .values() if e["kind"] == "straggler"], 60, "a straggler event", interval=0.5,
                         diag=diag)
        named_s = time.monotonic() - stepping_at
        assert [e["detail"]["node"] for e in named] == ["b"], named
        detail = named[0]["detail"]
        assert detail["compute_s"] >= SLEEP_S and detail["compute_s"] > detail["median_s"], detail
        doc = etcd_client.get_json(etcd_client.key("jobs", job, "stragglers"))
        assert [(r["node"], r["rank"]) for r in doc["ranks"]] == [("b", detail["ranks"][0])], doc
        assert main(["status", job, "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["jobs"][0]
        assert [s["node"] for s in row["stragglers"]] == ["b"], row
        assert main(["status", job]) == 0
        assert f"{job}: straggler b rank" in capsys.readouterr().out
        print(f"straggler named {named_s:.1f}s after the job was stepping (window 10s)")
    finally:
        main(["cancel", job])
        wait_for(lambda: job_state(etcd_client, job).get("state") == "CANCELLED", 60, "the job cancelled", diag=diag)

"""The goodput ledger of a live job with a killed rank and a hang, on one real agent (``slow``).

A rank is SIGKILLed, later rank 0 hangs once (the tiny worker's ``MARIND_TEST_HANG_AT_STEP``)
until ``hang_timeout``: the job succeeds and its ledger (`marind events --json`'s last line) has
``detection`` for the kill, ``hang`` for the stall (at least most of ``hang_timeout``), the
recoveries' causes, and parts that add up to its wall time within a second. The bed version
adds a power-off (tests/chaos/test_host_goodput_ledger.py); CI has the kill (test_job_page.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, tiny_spec, wait_for

pytestmark = pytest.mark.slow


def _marind(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", *argv], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def test_a_kill_and_a_hang_each_have_their_cause(tmp_path, etcd, etcd_client, etcd_prefix):
    env = {"MARIND_ETCD": etcd.endpoint, "MARIND_PREFIX": etcd_prefix}
    start_agent(tmp_path, "g", etcd.endpoint, etcd_prefix, env={"MARIND_TEST_STEP_SLEEP": "0.2"})
    diag = lambda: agent_log(tmp_path, "g")
    wait_for(lambda: node_registered(etcd_client, "g"), 30, "node g registered", diag=diag)
    spec = tiny_spec(tmp_path, name="ledger", nproc=2, steps=40, hang_timeout="10s",
                     env={"MARIND_TEST_HANG_AT_STEP": "25"})
    assert _marind(env, "submit", str(spec), "--id", "ledger-1").returncode == 0

    def step() -> int:
        return int((etcd_client.get_json(etcd_client.key("jobs", "ledger-1", "progress")) or {}).get("step") or 0)

    wait_for(lambda: step() >= 8, 180, "ledger-1 at step 8", diag=diag)
    record = etcd_client.get_json(etcd_client.key("jobs", "ledger-1", "nodes", "g"))
    os.kill(next(w["pid"] for w in record["workers"] if w["rank"] == 1), signal.SIGKILL)
    wait_for(lambda: job_state(etcd_client, "ledger-1").get("state") == "SUCCEEDED", 300, "ledger-1 SUCCEEDED",
             diag=lambda: f"{job_state(etcd_client, 'ledger-1')}\n{diag()}")
    kinds = [e["kind"] for e in json.loads("[" + ",".join(
        _marind(env, "events", "ledger-1", "--json").stdout.splitlines()) + "]")]
    assert "hang_detected" in kinds and kinds.count("restart") >= 2, kinds

    ledger = json.loads(_marind(env, "events", "ledger-1", "--json").stdout.splitlines()[-1])["detail"]
    s = ledger["seconds"]
    assert ledger["final"] and abs(sum(s.values()) - ledger["wall_s"]) < 1.0, ledger
    assert s["detection"] > 0 and s["hang"] >= 8 and s["training"] > 0, ledger       # hang_timeout 10 s
    assert s["rendezvous"] > 0 and s["restart"] > 0, ledger
    status = _marind(env, "status", "ledger-1").stdout
    assert "ledger-1: goodput " in status and "lost: " in status, status

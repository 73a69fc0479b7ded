"""The embedded etcd default, and an etcd outage under a running job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import psutil

from marind.core.etcd_client import EtcdClient
from marind.testing.procs import base_env, running, spawn
from tests.agent.helpers import (
    agent_log,
    done_record,
    job_state,
    metrics_port,
    node_registered,
    start_agent,
    tiny_spec,
    wait_for,
)


def _cli(*argv, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", *argv], env=base_env(env), capture_output=True,
                          text=True, timeout=60)


def test_embedded_etcd_is_found_by_the_cli(tmp_path):
    state = tmp_path / "state"
    log = open(tmp_path / "agent.log", "wb")
    agent = spawn([sys.executable, "-m", "marind", "agent", "--node", "solo", "--state-dir", str(state),
                   "--slots", "1", "--metrics-port", "0"], env={"MARIND_ETCD": ""},
                  stdout=log, stderr=subprocess.STDOUT)
    log.close()
    endpoint_file = state / "etcd.endpoint"
    diag = lambda: (tmp_path / "agent.log").read_text()
    wait_for(endpoint_file.exists, 30, "the embedded etcd's endpoint file", diag=diag)
    env = {"MARIND_STATE_DIR": str(state), "MARIND_ETCD": ""}
    wait_for(lambda: "solo" in _cli("nodes", env=env).stdout, 30, "marind nodes to list the node", diag=diag)
    res = _cli("nodes", "--json", env=env)
    assert json.loads(res.stdout)["nodes"][0]["node"] == "solo"
    etcd_pids = [c.pid for c in psutil.Process(agent.pid).children() if "etcd" in c.name()]
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    assert etcd_pids and not any(running(p) for p in etcd_pids)


def test_job_survives_an_etcd_outage(tmp_path, etcd_private):
    prefix = "/outage"
    client = EtcdClient(etcd_private.endpoint, prefix=prefix)
    agent = start_agent(tmp_path, "o", etcd_private.endpoint, prefix, env={"MARIND_LEASE_TTL": "4"})
    diag = lambda: agent_log(tmp_path, "o")
    wait_for(lambda: node_registered(client, "o"), 30, "node registered", diag=diag)
    spec = tiny_spec(tmp_path, name="outage", steps=30)
    res = _cli("submit", str(spec), env={"MARIND_ETCD": etcd_private.endpoint, "MARIND_PREFIX": prefix})
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: (r := client.get_json(client.key("jobs", job, "nodes", "o")))
                      and r["step"] >= 2 and r, 90, "the job running", diag=diag)
    progress = tmp_path / "state-o" / "jobs" / job / "progress" / "rank-0.json"
    local_step = lambda: json.loads(progress.read_text())["step"] if progress.exists() else -1
    etcd_private.stop()
    step_at_outage = local_step()
    res = _cli("status", env={"MARIND_ETCD": etcd_private.endpoint, "MARIND_PREFIX": prefix})
    assert res.returncode == 3
    # the rendezvous rides out a short outage (etcd_grace_timeout): the workers keep training
    # while etcd is down, and the agent stays up and keeps supervising
    wait_for(lambda: local_step() >= step_at_outage + 3, 60, "training to go on while etcd is down",
             diag=diag)
    assert agent.poll() is None
    etcd_private.start()
    wait_for(lambda: job_state(client, job).get("state") == "SUCCEEDED", 120, "SUCCEEDED after the outage",
             diag=lambda: f"{job_state(client, job)}\n{diag()}")
    assert done_record(spec)["step"] == 30
    wait_for(lambda: node_registered(client, "o"), 30, "node registered again", diag=diag)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(tmp_path, 'o')}/metrics", timeout=5).read().decode()
    failures = [line for line in text.splitlines() if line.startswith("marind_etcd_keepalive_failures_total ")]
    assert failures and float(failures[0].split()[1]) >= 1
    client.close()

"""Shared helpers of the agent and CLI tests: specs, agents as subprocesses, bounded waits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from marind.core.etcd_client import EtcdClient
from marind.testing.procs import spawn

# rendezvous settings that keep the tests short: no waiting for extra nodes, fast node-loss detection
FAST_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


def tiny_spec(tmp: Path, *, name: str = "tiny", nodes: str = "1:1", nproc: int = 2, steps: int = 10,
              max_restarts: int = 5, hang_timeout: str = "60s", env: dict | None = None) -> Path:
    ckpt = tmp / f"ckpt-{name}"
    env_table = "".join(f'{k} = "{v}"\n' for k, v in (env or {}).items())
    text = f"""
[job]
name = "{name}"
nodes = "{nodes}"
nproc_per_node = {nproc}
max_restarts = {max_restarts}
hang_timeout = "{hang_timeout}"
entrypoint = "tests.agent.tiny_worker"
{"[job.env]" if env else ""}
{env_table}
[data]
path = "unused"
global_batch = 8
micro_batch = 1

[train]
steps = {steps}

[checkpoint]
url = "file://{ckpt}"
"""
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def start_agent(tmp: Path, node: str, etcd: str, prefix: str, *, slots: int = 2,
                env: dict | None = None, notify_socket: str | None = None) -> subprocess.Popen:
    state = tmp / f"state-{node}"
    state.mkdir(parents=True, exist_ok=True)
    log = open(tmp / f"agent-{node}.log", "ab")
    agent_env = {"MARIND_PREFIX": prefix, "MARIND_RDZV_CONF": FAST_RDZV, "MARIND_REPORT_INTERVAL": "0.5",
                 "MARIND_STOP_TIMEOUT": "15", "MARIND_TEST_STEP_SLEEP": "0.2", **(env or {})}
    if notify_socket:
        agent_env["NOTIFY_SOCKET"] = notify_socket
    cmd = [sys.executable, "-m", "marind", "agent", "--node", node, "--etcd", etcd,
           "--state-dir", str(state), "--slots", str(slots), "--metrics-port", "-1"]
    proc = spawn(cmd, env=agent_env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def agent_log(tmp: Path, node: str) -> str:
    try:
        return (tmp / f"agent-{node}.log").read_text(errors="replace")[-6000:]
    except OSError:
        return ""


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2, diag=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{diag()}")


def job_state(client: EtcdClient, job: str) -> dict:
    return client.get_json(client.key("jobs", job, "state")) or {}


def node_registered(client: EtcdClient, node: str) -> dict | None:
    return client.get_json(client.key("nodes", node))


def metrics_port(tmp: Path, node: str) -> int:
    return int((tmp / f"state-{node}" / "metrics.port").read_text())


def done_record(spec_path: Path) -> dict | None:
    import tomllib
    url = tomllib.loads(spec_path.read_text())["checkpoint"]["url"].removeprefix("file://")
    path = Path(url) / "done.json"
    return json.loads(path.read_text()) if path.exists() else None

"""Seeing a job, with a real agent on the session etcd: reasons, restart counts, events, logs -f, metrics.

A crash-looping job (a worker that fails as a missing dataset index does) shows its reason and
its true restart count in `status` and `events`; `events -f` and `logs -f` end with the job (exit 4
for a failed job, 0 for one that SUCCEEDED); the agent's /metrics carries the running job's series
and drops them when the job ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from marind.testing.procs import spawn
from tests.agent.helpers import agent_log, job_state, metrics_port, node_registered, start_agent, tiny_spec, wait_for

MISSING = "FileNotFoundError: [Errno 2] No such file or directory: 'data/example.idx'"


def _crash_spec(tmp, max_restarts: int):
    path = tiny_spec(tmp, name="crash", nproc=1, max_restarts=max_restarts)
    path.write_text(path.read_text().replace("tests.agent.tiny_worker", "tests.agent.crash_worker")
                    .replace('path = "unused"', 'path = "data/example.idx"'))
    return path


def _marind(env: dict, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _follow(env: dict, tmp, name: str, *argv: str) -> tuple[subprocess.Popen, object]:
    out = open(tmp / f"{name}.out", "w+")
    return spawn([sys.executable, "-m", "marind", *argv], env=env, stdout=out, stderr=subprocess.STDOUT), out


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_a_crash_loop_and_a_good_job_are_visible(tmp_path, etcd, etcd_client, etcd_prefix):
    env = {"MARIND_ETCD": etcd.endpoint, "MARIND_PREFIX": etcd_prefix}
    agent = start_agent(tmp_path, "v", etcd.endpoint, etcd_prefix, env={"MARIND_TEST_CRASH_AFTER": "0"})
    diag = lambda: agent_log(tmp_path, "v")
    wait_for(lambda: node_registered(etcd_client, "v"), 30, "node v registered", diag=diag)

    # 1. a job whose workers fail at once, every round: 2 restarts, then FAILED, with the reason
    assert _marind(env, "submit", str(_crash_spec(tmp_path, 2)), "--id", "crash-1").returncode == 0
    events_f, events_out = _follow(env, tmp_path, "events-crash", "events", "crash-1", "-f", "--json")
    log = tmp_path / "state-v" / "jobs" / "crash-1" / "logs" / "torchrun.log"
    wait_for(log.exists, 60, "the crash job's log", diag=diag)
    logs_f, logs_out = _follow(env, tmp_path, "logs-crash", "logs", "crash-1", "-f",
                               "--state-dir", str(tmp_path / "state-v"))
    wait_for(lambda: job_state(etcd_client, "crash-1").get("state") == "FAILED", 120, "crash-1 FAILED",
             diag=lambda: f"{job_state(etcd_client, 'crash-1')}\n{diag()}")
    assert events_f.wait(60) == 4 and logs_f.wait(60) == 4
    lines = [json.loads(line) for line in open(events_out.name) if line.startswith("{")]
    restarts = [e["detail"] for e in lines if e["kind"] == "restart"]
    assert [r["restarts"] for r in restarts] == [1, 2] and all(MISSING in r["reason"] for r in restarts)
    assert all(r["cause"] == "data_missing" and r["reason"].startswith("rank 0 (local 0) on v: ") for r in restarts)
    assert lines[-1]["kind"] == "failed" and MISSING in lines[-1]["detail"]["reason"]
    assert MISSING in open(logs_out.name).read()
    doc = json.loads(_marind(env, "status", "crash-1", "--json").stdout)
    row = doc["jobs"][0]
    assert (row["state"], row["restarts"]) == ("FAILED", 2) and MISSING in row["reason"]
    assert row["last_error"]["cause"] == "data_missing" and "working_dir" in row["last_error"]["fix"]
    table = _marind(env, "status").stdout.splitlines()
    header = next(line for line in table if line.startswith("JOB"))
    crash = next(line for line in table if line.startswith("crash-1"))
    assert "REASON" in header and crash.split()[8] == "2" and "FileNotFoundError" in crash
    out = _marind(env, "events", "crash-1")
    assert out.returncode == 0 and any(" restart " in line and "restarts=2 " in line and MISSING in line.split("reason=", 1)[-1]
                                       for line in out.stdout.splitlines()), out.stdout
    assert _marind(env, "events", "crash-1", "-f").returncode == 4       # terminal already: ends at once

    # 2. a job that trains: its series on /metrics while it runs, gone after; events -f / logs -f exit 0
    spec = tiny_spec(tmp_path, name="good", nproc=1, steps=40)
    assert _marind(env, "submit", str(spec), "--id", "good-1").returncode == 0
    events_f, events_out = _follow(env, tmp_path, "events-good", "events", "good-1", "-f", "--json")
    log = tmp_path / "state-v" / "jobs" / "good-1" / "logs" / "torchrun.log"
    wait_for(log.exists, 60, "the good job's log", diag=diag)
    logs_f, _ = _follow(env, tmp_path, "logs-good", "logs", "good-1", "-f", "--state-dir", str(tmp_path / "state-v"))
    port = metrics_port(tmp_path, "v")
    text = wait_for(lambda: (t := _scrape(port)) and 'marind_checkpoint_duration_seconds_count{job="good-1"}' in t
                    and 'marind_job_last_checkpoint_step{job="good-1"}' in t and t, 90,
                    "the good job's series", diag=lambda: _scrape(port))
    assert 'marind_job_step{job="good-1"}' in text and 'marind_job_loss{job="good-1"}' in text
    assert 'marind_job_tokens_per_second{job="good-1"}' in text and 'marind_job_restarts_total{job="good-1"} 0' in text
    assert events_f.wait(120) == 0 and logs_f.wait(60) == 0
    kinds = [json.loads(line)["kind"] for line in open(events_out.name) if line.startswith("{")]
    assert "checkpoint_committed" in kinds and kinds[-1] == "succeeded"
    wait_for(lambda: 'job="good-1"' not in _scrape(port), 30, "the good job's series removed")
    assert agent.poll() is None

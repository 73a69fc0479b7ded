"""One real agent (subprocess) on the session etcd running real torchrun jobs.

One agent serves several scenarios to keep the suite short: a job runs to
SUCCEEDED (status --json, logs, events, metrics, sd_notify READY), a
second is cancelled while running, a third hangs once and is restarted
by hang detection; then SIGTERM stops the agent cleanly (STOPPING=1).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request

import pytest

from marind.cli import main
from marind.testing.procs import running
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


class NotifyCollector:
    """A real AF_UNIX datagram socket, read by a thread (as systemd would) into ``messages``."""

    def __init__(self, path: str):
        import threading
        self.path = path
        self.messages: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except (TimeoutError, OSError):
                continue

    def seen(self, text: str) -> bool:
        return any(text in m for m in list(self.messages))

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def notify_sock(tmp_path):
    collector = NotifyCollector(str(tmp_path / "notify.sock"))
    yield collector
    collector.close()


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_agent_runs_cancels_and_recovers_jobs(tmp_path, etcd, etcd_client, etcd_prefix, notify_sock,
                                              capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "state-a"))
    agent = start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix, notify_socket=notify_sock.path,
                        env={"WATCHDOG_USEC": "2000000"})
    diag = lambda: agent_log(tmp_path, "a")
    wait_for(lambda: node_registered(etcd_client, "a"), 30, "node a registered", diag=diag)
    wait_for(lambda: notify_sock.seen("READY=1"), 10, "sd_notify READY=1")

    # 1. a job runs to SUCCEEDED with every step accounted for
    spec = tiny_spec(tmp_path, name="ok", steps=8)
    rc, out, _ = _cli(capsys, "submit", str(spec))
    assert rc == 0
    job = out.strip().splitlines()[-1]
    wait_for(lambda: job_state(etcd_client, job).get("state") == "SUCCEEDED", 90, f"{job} SUCCEEDED",
             diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    assert done_record(spec)["step"] == 8
    rc, out, _ = _cli(capsys, "status", job, "--json")
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["jobs"][0]["id"] == job
    row = doc["jobs"][0]
    assert set(row) == {"id", "name", "state", "nodes", "world_size", "step", "loss", "tokens_per_s",
                        "last_checkpoint_step", "restarts", "reason", "updated_at"}
    assert row["state"] == "SUCCEEDED" and row["step"] == 8 and row["world_size"] == 2
    assert [n["node"] for n in doc["nodes"]] == ["a"]
    rc, out, _ = _cli(capsys, "logs", job)
    assert rc == 0 and "starting torchrun" in out
    kinds = [e["kind"] for e in etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/").values()]
    assert "node_joined" in kinds and "succeeded" in kinds

    # 2. cancel a running job: its workers stop within seconds
    spec = tiny_spec(tmp_path, name="long", steps=10_000)
    rc, out, _ = _cli(capsys, "submit", str(spec))
    job = out.strip().splitlines()[-1]
    record = wait_for(lambda: (r := etcd_client.get_json(etcd_client.key("jobs", job, "nodes", "a")))
                      and len(r["workers"]) == 2 and r["step"] > 0 and r, 90, "workers of the long job",
                      diag=diag)
    pids = [record["torchrun_pid"], *(w["pid"] for w in record["workers"])]
    rc, out, _ = _cli(capsys, "cancel", job)
    assert rc == 0
    assert job_state(etcd_client, job)["state"] == "CANCELLED"
    wait_for(lambda: not any(running(p) for p in pids), 30, "cancelled job's processes gone", diag=diag)

    # 3. a rank hangs once: hang detection dumps stacks, kills the workers, torchrun restarts them
    spec = tiny_spec(tmp_path, name="hang", steps=6, hang_timeout="4s",
                     env={"MARIND_TEST_HANG_AT_STEP": "3"})
    rc, out, _ = _cli(capsys, "submit", str(spec))
    job = out.strip().splitlines()[-1]
    wait_for(lambda: job_state(etcd_client, job).get("state") == "SUCCEEDED", 120, f"{job} SUCCEEDED",
             diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    kinds = [e["kind"] for e in etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/").values()]
    assert "hang_detected" in kinds and "restart" in kinds
    assert job_state(etcd_client, job)["restarts"] >= 1
    assert done_record(spec)["step"] == 6
    rc, out, _ = _cli(capsys, "logs", job)
    assert "Thread" in out or "Current thread" in out   # faulthandler's stack dump of the stuck rank

    # metrics
    port = metrics_port(tmp_path, "a")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "marind_build_info{" in text and "marind_restarts_total 1" in text
    assert "marind_rendezvous_rounds_total" in text and "marind_etcd_keepalive_failures_total 0" in text
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200

    # SIGTERM: clean stop, node deregistered, STOPPING=1 sent
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(30) == 0
    assert node_registered(etcd_client, "a") is None
    wait_for(lambda: notify_sock.seen("STOPPING=1"), 5, "sd_notify STOPPING=1")
    assert notify_sock.seen("WATCHDOG=1") and notify_sock.seen("STATUS=")

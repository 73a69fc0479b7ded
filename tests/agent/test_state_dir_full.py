"""A real agent whose state dir fills while a job runs (issue 32): it keeps supervising and says why.

The agent's ``--state-dir`` is a 32 MiB tmpfs (``marind.testing.small_fs``; root only). A tiny job
(1 rank, a line of output per step) runs; the test fills the tmpfs with ballast (a real ENOSPC).
Then, while it is full:

* the job goes on stepping (its progress record goes on through its spare; its output is dropped by
  the relay, never failing a print of the worker);
* a ``state_dir_full`` event on the job names the path and the free bytes; ``marind status`` gives
  the reason (the node's line, the job's JSON reason), ``marind doctor``'s agent row fails naming
  the node, the gauge ``marind_state_dir_full`` is 1;
* a second job submitted now is not started on this node (a ``state_dir_full`` event with its
  ``action``; it stays PENDING).

The ballast goes: a ``state_dir_recovered`` event on both jobs, the node's record is clean again,
the first job's output reaches its log again after a marker line saying what was dropped, and both
jobs run to SUCCEEDED. No timing is asserted: every wait is bounded, nothing more.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from marind.cli import main
from marind.commands.doctor import check_agent_state_dirs
from marind.control.events import STATE_DIR_FULL, STATE_DIR_RECOVERED, list_events
from marind.testing.small_fs import can_mount, fill, small_tmpfs
from tests.agent.helpers import (
    agent_log,
    done_record,
    job_state,
    node_registered,
    start_agent,
    tiny_spec,
    wait_for,
)

pytestmark = pytest.mark.skipif(can_mount() is not None, reason=can_mount() or "")


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def _events(client, job: str, kind: str) -> list[dict]:
    return [e for e in list_events(client, job) if e["kind"] == kind]


def _step(client, job: str) -> int:
    rec = client.get_json(client.key("jobs", job, "nodes", "a")) or {}
    return int(rec.get("step") or 0)


def test_a_full_state_dir_keeps_the_job_running_says_why_and_recovers(tmp_path, etcd, etcd_client, etcd_prefix,
                                                                         capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    with small_tmpfs(tmp_path / "state-a", 32) as state:
        agent = start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix)
        diag = lambda: agent_log(tmp_path, "a")
        try:
            wait_for(lambda: node_registered(etcd_client, "a"), 30, "node a registered", diag=diag)
            gate = tmp_path / "gate"          # the job's last step waits for it: the job outlasts the full spell
            spec = tiny_spec(tmp_path, name="long", nproc=1, steps=30,
                             env={"MARIND_TEST_PRINT_STEPS": "1", "MARIND_TEST_LAST_STEP_GATE": str(gate)})
            rc, out = _cli(capsys, "submit", str(spec))
            assert rc == 0
            job = out.strip().splitlines()[-1]
            wait_for(lambda: _step(etcd_client, job) >= 2, 120, f"{job} stepping", diag=diag)

            ballast = fill(state)
            full = wait_for(lambda: _events(etcd_client, job, STATE_DIR_FULL), 30, "the state_dir_full event",
                            diag=diag)
            assert len(full) == 1 and full[0]["node"] == "a"
            detail = full[0]["detail"]
            assert detail["path"] == str(state) and detail["free_bytes"] < 1 << 20 and detail["effect"]
            at_full = _step(etcd_client, job)

            rc, out = _cli(capsys, "status", "--json")
            doc = json.loads(out)
            node = next(n for n in doc["nodes"] if n["node"] == "a")
            assert node["state_dir_full"]["path"] == str(state) and "fix:" in node["state_dir_full"]["reason"]
            row = next(j for j in doc["jobs"] if j["id"] == job)
            assert row["state"] == "RUNNING" and row["reason"].startswith(f"node a: state dir {state} is full")
            rc, out = _cli(capsys, "status")
            assert f"node a: state dir {state} is full" in out
            check = check_agent_state_dirs(None, None)
            assert check is not None and not check.ok and "node a" in check.detail
            port = int((state / "metrics.port").read_text())
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert "marind_state_dir_full 1" in metrics

            spec2 = tiny_spec(tmp_path, name="later", nproc=1, steps=3)
            rc, out = _cli(capsys, "submit", str(spec2))
            job2 = out.strip().splitlines()[-1]
            held = wait_for(lambda: _events(etcd_client, job2, STATE_DIR_FULL), 30, "the second job held back",
                            diag=diag)
            assert "not started" in held[0]["detail"]["action"]
            assert job_state(etcd_client, job2)["state"] == "PENDING"

            wait_for(lambda: _step(etcd_client, job) >= at_full + 5, 60, "steps while the state dir is full",
                     diag=diag)
            assert agent.poll() is None
            assert job_state(etcd_client, job)["state"] == "RUNNING"

            ballast.unlink()
            for j in (job, job2):
                back = wait_for(lambda j=j: _events(etcd_client, j, STATE_DIR_RECOVERED), 30,
                                f"state_dir_recovered on {j}", diag=diag)
                detail = back[0]["detail"]
                assert detail["path"] == str(state) and detail["free_bytes"] > 1 << 20
                assert "torchrun output" in detail["dropped"]          # the relay dropped the worker's lines
            wait_for(lambda: "state_dir_full" not in (node_registered(etcd_client, "a") or {"state_dir_full": 1}),
                     10, "the node's record clean again", diag=diag)
            gate.touch()
            for j in (job, job2):
                wait_for(lambda j=j: job_state(etcd_client, j).get("state") == "SUCCEEDED", 120, f"{j} SUCCEEDED",
                         diag=lambda j=j: f"{job_state(etcd_client, j)}\n{diag()}")
            assert done_record(spec)["step"] == 30 and done_record(spec2)["step"] == 3
            assert len(_events(etcd_client, job, STATE_DIR_FULL)) == 1         # said once
            log = (state / "jobs" / job / "logs" / "torchrun.log").read_text()
            assert "bytes of output dropped here (ENOSPC" in log, log[-3000:]
            assert "rank 0 step 30 " in log[log.index("bytes of output dropped here"):]
        finally:
            if agent.poll() is None:
                os.kill(agent.pid, signal.SIGTERM)
                try:
                    agent.wait(60)
                except Exception:  # noqa: BLE001 - the fixture kills it; the tmpfs goes lazily then
                    agent.kill()

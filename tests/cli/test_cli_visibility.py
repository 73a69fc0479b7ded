"""The CLI's new surface without agents: event lines, the reason, closed pipes, `ckpt ls` of nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from marind.cli import main
from marind.commands.events import format_detail, format_event
from marind.control.jobs_client import row_reason
from tests.agent.helpers import tiny_spec


@pytest.mark.unit
def test_event_lines():
    line = format_event({"at": 0, "node": "n1", "kind": "restart", "seq": 3,
                         "detail": {"reason": "ValueError: x", "restarts": 2, "round": 3}})
    assert line.split() == ["1970-01-01T00:00:00Z", "n1", "restart", "restarts=2", "round=3", "reason=ValueError:", "x"]
    assert format_detail({"stack_dump": "/r/logs/torchrun.log", "ranks": [0, 1]}) == \
        "ranks=[0,1] stack_dump=/r/logs/torchrun.log"
    assert format_detail("text") == "text" and format_detail(None) == ""
    assert format_event({"kind": "x"}).startswith("1970-01-01T00:00:00Z  -")


@pytest.mark.unit
def test_row_reason():
    err = {"line": "FileNotFoundError: data", "node": "n1"}
    assert row_reason("FAILED", "torchrun exited 1", err) == "FileNotFoundError: data"
    assert row_reason("RESTARTING", "workers restarted", err) == "FileNotFoundError: data"
    assert row_reason("RUNNING", "workers running", err) == "workers running"
    assert row_reason("FAILED", "torchrun exited 1", None) == "torchrun exited 1"


@pytest.mark.unit
def test_ckpt_ls_of_a_missing_path_exits_1(tmp_path, capsys):
    assert main(["ckpt", "ls", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: no checkpoint store at") and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert main(["ckpt", "ls", f"file://{tmp_path / 'empty'}"]) == 0
    assert "No checkpoints" in capsys.readouterr().out


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARIND_")}
    env["PYTHONPATH"] = os.getcwd()
    return env | extra


def test_status_into_a_closed_pipe_exits_0(etcd, etcd_prefix, tmp_path):
    env = _env(MARIND_ETCD=etcd.endpoint, MARIND_PREFIX=etcd_prefix)
    subprocess.run([sys.executable, "-m", "marind", "submit", str(tiny_spec(tmp_path)), "--id", "pipe-1"],
                   env=env, check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "marind", "status"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                   # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err
    shell = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m marind status | head -1"],
                           env=env, capture_output=True, timeout=60)
    assert shell.returncode == 0 and shell.stdout.decode() == "No nodes.\n", shell
    assert b"Traceback" not in shell.stderr


def test_status_finds_the_agent_etcd_through_the_state_dir(etcd, etcd_prefix, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "etcd.endpoint").write_text(etcd.endpoint + "\n")     # what an agent leaves in its state dir
    env = _env(MARIND_PREFIX=etcd_prefix, HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "xdg"))
    run = lambda *argv, **kw: subprocess.run([sys.executable, "-m", "marind", *argv], env=env | kw,
                                             capture_output=True, text=True, timeout=60)
    out = run("status", "--json", "--state-dir", str(state))
    assert out.returncode == 0 and json.loads(out.stdout)["jobs"] == [], out.stderr
    out = run("status", "--json", MARIND_STATE_DIR=str(state))
    assert out.returncode == 0, out.stderr
    out = run("status")
    assert out.returncode == 3 and "no etcd configured" in out.stderr


def test_a_cancel_is_an_event_and_ends_events_follow(etcd, etcd_prefix, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    assert main(["submit", str(tiny_spec(tmp_path)), "--id", "cancel-1"]) == 0
    assert main(["events", "cancel-1"]) == 0
    assert "No events of job cancel-1." in capsys.readouterr().out
    assert main(["cancel", "cancel-1"]) == 0
    capsys.readouterr()
    assert main(["events", "cancel-1", "-f", "--json"]) == 4
    cap = capsys.readouterr()
    (event,) = [json.loads(line) for line in cap.out.splitlines()]
    assert event["kind"] == "cancelled" and event["detail"]["by"] == event["node"] and "@" in event["node"]
    assert cap.err.startswith("Error: job cancel-1 CANCELLED")
    assert main(["events", "nope"]) == 1

"""Pure parts of the agent: transitions, stall detection, progress, config, command lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from marind.agent import progress as prog
from marind.agent.hang import HangDetector
from marind.agent.torchrun_args import spec_to_toml, torchrun_command, worker_env
from marind.control.config import load_config, parse_config_text, resolve_endpoint
from marind.control.lifecycle import JobEvent, JobState, StateRecord, apply, transition
from marind.core.errors import ControlPlaneUnavailable, SpecError
from marind.core.spec import load_spec

pytestmark = pytest.mark.unit


def test_terminal_states_never_change():
    for state in JobState:
        for event in JobEvent:
            new, reason = transition(state, event)
            assert reason
            if state.is_terminal():
                assert new == state
    assert transition(JobState.PENDING, JobEvent.WORKERS_STARTED)[0] == JobState.RUNNING
    assert transition(JobState.RUNNING, JobEvent.RESTART)[0] == JobState.RESTARTING
    assert transition(JobState.RESTARTING, JobEvent.WORKERS_STARTED)[0] == JobState.RUNNING
    assert transition(JobState.RUNNING, JobEvent.SUCCEEDED)[0] == JobState.SUCCEEDED
    assert transition(JobState.RESTARTING, JobEvent.FAILED)[0] == JobState.FAILED
    assert transition(JobState.PENDING, JobEvent.CANCEL)[0] == JobState.CANCELLED
    assert transition(JobState.RUNNING, JobEvent.WORKERS_STARTED)[0] == JobState.RUNNING


def test_apply_keeps_the_highest_restart_count_and_skips_no_ops():
    rec = StateRecord(JobState.RUNNING, restarts=2)
    assert apply(rec, JobEvent.WORKERS_STARTED) is None
    new = apply(rec, JobEvent.RESTART, restarts=1, now=5.0)
    assert new.state == JobState.RESTARTING and new.restarts == 2 and new.updated_at == 5.0
    assert apply(StateRecord(JobState.SUCCEEDED), JobEvent.FAILED, restarts=9) is None
    assert StateRecord.from_dict(new.to_dict()) == new
    assert "step" not in new.to_dict() and apply(rec, JobEvent.RESTART, step=7).step is None


def test_a_terminal_state_keeps_the_step_the_job_ended_at():
    done = apply(StateRecord(JobState.RUNNING, restarts=1), JobEvent.SUCCEEDED, step=60, now=3.0)
    assert (done.state, done.step, done.restarts) == (JobState.SUCCEEDED, 60, 1)
    assert StateRecord.from_dict(done.to_dict()) == done
    assert apply(done, JobEvent.FAILED, step=61) is None


def test_hang_detector_with_injected_clock():
    det = HangDetector(timeout=10)
    assert det.check(1000) == (False, "no progress seen yet")
    det.observe(0, None)
    assert not det.check(100)[0]
    det.observe(0, (1, ("training",)))
    det.observe(9, (1, ("training",)))
    assert not det.check(9)[0]
    hung, why = det.check(10.5)
    assert hung and "hang_timeout 10s" in why
    det.observe(11, (2, ("training",)))
    assert not det.check(20)[0]
    det.reset()
    assert not det.check(10_000)[0]


def _rec(rank, pid, step, phase="training", **kw):
    return prog.ProgressRecord(rank=rank, local_rank=rank % 2, world_size=4, pid=pid, step=step, loss=1.0,
                               tokens_per_s=10.0, last_checkpoint_step=kw.get("ckpt"), phase=phase,
                               updated_at=kw.get("at", 1.0))


def test_progress_aggregation(tmp_path):
    d = prog.progress_dir(tmp_path)
    d.mkdir()
    (d / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 11, "step": 5, "phase": "training"}))
    (d / "rank-1.json").write_text("{half written")
    (d / "rank-2.json").write_text(json.dumps({"rank": 2, "pid": 99, "step": 1}))
    records = prog.read_records(tmp_path)
    assert [r.rank for r in records] == [0, 2]
    live = prog.current(records, {11})
    assert [r.rank for r in live] == [0]
    assert prog.node_step(live) == 5
    recs = [_rec(1, 1, 7), _rec(0, 2, 6, ckpt=4)]
    assert prog.stall_marker(recs) == (6, ("training",))
    assert prog.stall_marker([]) is None
    summary = prog.job_summary(recs)
    assert summary["step"] == 6 and summary["last_checkpoint_step"] == 4 and summary["world_size"] == 4
    assert prog.job_summary([_rec(1, 1, 7)]) is None
    assert prog.all_done([_rec(0, 1, 3, "done")]) and not prog.all_done([])


def test_config_precedence(tmp_path):
    cfg = tmp_path / "marind.toml"
    cfg.write_text('[agent]\nnode = "from-file"\nslots = 4\n[etcd]\nendpoints = ["http://a:1", "http://b:2"]\n')
    c = load_config(str(cfg), env={}, flags={})
    assert (c.node, c.slots, c.etcd) == ("from-file", 4, "http://a:1,http://b:2")
    c = load_config(str(cfg), env={"MARIND_SLOTS": "6", "MARIND_NODE": "env"}, flags={"node": "flag"})
    assert (c.node, c.slots) == ("flag", 6)
    with pytest.raises(SpecError, match="did you mean agent.slots"):
        parse_config_text("[agent]\nslot = 1\n")
    with pytest.raises(SpecError, match="slots must be a number"):
        load_config(str(cfg), env={"MARIND_SLOTS": "many"})


def test_endpoint_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    state = tmp_path / "state"
    state.mkdir()
    (state / "etcd.endpoint").write_text("http://127.0.0.1:1234\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[etcd]\nendpoints = "http://cfg:1"\n')
    env = {"MARIND_STATE_DIR": str(state)}
    assert resolve_endpoint(None, str(tmp_path / "none.toml"), env)[0] == "http://127.0.0.1:1234"
    assert resolve_endpoint(None, str(cfg), env)[0] == "http://cfg:1"
    assert resolve_endpoint(None, str(cfg), {**env, "MARIND_ETCD": "http://env:1"})[0] == "http://env:1"
    assert resolve_endpoint("http://flag:1", str(cfg), {"MARIND_ETCD": "x"})[0] == "http://flag:1"
    with pytest.raises(ControlPlaneUnavailable, match="no etcd configured"):
        resolve_endpoint(None, str(tmp_path / "none.toml"), {"MARIND_STATE_DIR": str(tmp_path / "empty")})


SPEC = """
[job]
name = "t"
nodes = "1:3"
nproc_per_node = 2
max_restarts = 7
entrypoint = "marind.trainer"
[job.env]
FOO = "bar baz"
[data]
path = "data/x"
global_batch = 12
micro_batch = 1
[checkpoint]
url = "file:///tmp/c"
"""


def test_run_toml_round_trip_and_command(tmp_path):
    spec = load_spec(SPEC)
    text = spec_to_toml(spec.to_dict())
    assert load_spec(text).to_dict() == spec.to_dict()
    cmd = torchrun_command(python="py", job="j1", spec=spec, endpoint="http://h:2379,http://g:1",
                           prefix="/p", run_toml=Path("/r/run.toml"), rdzv_conf="last_call_timeout=1")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--rdzv-backend=etcd3" in cmd and "--rdzv-endpoint=h:2379,g:1" in cmd and "--rdzv-id=j1" in cmd
    assert "--nnodes=1:3" in cmd and "--nproc-per-node=2" in cmd and "--max-restarts=7" in cmd
    assert "--rdzv-conf=prefix=/p,last_call_timeout=1" in cmd
    assert cmd[-4:] == ["-m", "marind.agent.warm_start.zygote_stub", "marind.trainer", "/r/run.toml"]     # warm_start (default)
    cold = spec.replace(job=dataclasses.replace(spec.job, warm_start=False))
    assert torchrun_command(python="py", job="j1", spec=cold, endpoint="h:1", prefix="/p",       # the launcher
                            run_toml=Path("/r/run.toml"))[-4:] == ["-m", "marind.agent.warm_start.zygote_stub", "marind.trainer",
                                                                   "/r/run.toml"]            # enters working_dir
    script = spec.replace(job=dataclasses.replace(spec.job, entrypoint="", command=("python", "t.py", "--lr", "1")))
    assert torchrun_command(python="py", job="j1", spec=script, endpoint="h:1", prefix="/p",
                            run_toml=Path("/r/run.toml"))[-7:] == ["-m", "marind.agent.warm_start.zygote_stub", "--command",
                                                                   "python", "t.py", "--lr", "1"]
    env = worker_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "PATH": "/bin"}, job="j1", node="n",
                     run_dir=tmp_path, spec=spec)
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["MARIND_ZYGOTE_SOCKET"].startswith("@marind-zygote-") and env["MARIND_ZYGOTE_PRELOAD"] == ""
    assert env["MARIND_RUN_TOML"] == str(tmp_path / "run.toml") and "MARIND_WORKING_DIR" not in env
    assert "MARIND_ZYGOTE_SOCKET" not in worker_env({}, job="j1", node="n", run_dir=tmp_path, spec=cold)
    shell = script.replace(job=dataclasses.replace(script.job, command=("bash", "run.sh"), preload=("a.b",),
                                                   working_dir="/w"))
    env = worker_env({}, job="j1", node="n", run_dir=tmp_path, spec=shell)
    assert "MARIND_ZYGOTE_SOCKET" not in env and env["MARIND_WORKING_DIR"] == "/w"    # no python: no zygote
    env = worker_env({}, job="j1", node="n", run_dir=tmp_path, spec=script.replace(job=dataclasses.replace(
        script.job, preload=("a.b", "c"))))
    assert env["MARIND_ZYGOTE_PRELOAD"] == "a.b,c"
    assert env["MARIND_RUN_DIR"] == str(tmp_path) and env["MARIND_JOB_ID"] == "j1" and env["FOO"] == "bar baz"

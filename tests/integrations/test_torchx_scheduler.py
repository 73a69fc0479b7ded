"""`torchx run -s marind dist.ddp ...` against a real etcd and two real agents (two nodes on this host).

The app is submitted with TorchX's CLI (the scheduler found through its entry point), one rank is
SIGKILLed mid-run by the chaos injector, and TorchX's Python API sees the app end SUCCEEDED with the
restart counted; its logs, list and cancel go through the same scheduler.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from torchx.runner import get_runner
from torchx.specs import AppState

from marind.testing import procs
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for

REPO = Path(__file__).resolve().parents[2]
TORCHX = Path(sys.executable).with_name("torchx")

TRAIN = textwrap.dedent("""
    # a DDP-style script as a TorchX user has it: torchrun's environment, gloo, a step file to resume from
    import argparse, time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from marind.worker.reporting import finish, report    # progress: what `--after-step` and hang detection read

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = Path("step.txt")
    t = torch.tensor([int(state.read_text()) if state.exists() else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step = int(t.item())
    print(f"rank {rank}/{world} starts at step {step}", flush=True)
    while step < a.steps:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.3)
        step += 1
        if rank == 0:
            state.write_text(str(step))
        report(step, loss=1.0 / step)
    finish()
    if rank == 0:
        print(f"train done at step {step} world {world}", flush=True)
    dist.destroy_process_group()
""")


def _torchx(args: list[str], cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(TORCHX), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchx_app_survives_a_killed_rank(tmp_path, etcd, etcd_client, etcd_prefix, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "state-a"))      # where `torchx log` reads
    env = {"MARIND_TEST_STEP_SLEEP": "0.3"}
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix, env=env)
    start_agent(tmp_path, "b", etcd.endpoint, etcd_prefix, env=env)
    diag = lambda: f"--- a ---\n{agent_log(tmp_path, 'a')}\n--- b ---\n{agent_log(tmp_path, 'b')}"
    wait_for(lambda: node_registered(etcd_client, "a") and node_registered(etcd_client, "b"), 30,
             "both nodes registered", diag=diag)
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)

    cli_env = dict(os.environ)
    run = _torchx(["run", "-s", "marind", "-cfg", "max_restarts=5,hang_timeout=60s",
                   "dist.ddp", "-j", "2x1", "--script", "train.py", "--", "--steps", "24"], work, cli_env)
    handles = [line for line in run.stdout.splitlines() if line.startswith("marind://")]
    assert run.returncode == 0 and handles, run.stdout + run.stderr
    handle = handles[-1]
    job = handle.rsplit("/", 1)[-1]

    def two_ranks_stepping():
        doc = etcd_client.get_json(etcd_client.key("jobs", job, "progress")) or {}
        return doc.get("world_size") == 2 and (doc.get("step") or 0) >= 3
    wait_for(two_ranks_stepping, 150, "the app running on two nodes", diag=diag)

    kill = procs.spawn([sys.executable, str(REPO / "chaos" / "kill_random_rank.py"), "--job", job,
                        "--etcd", etcd.endpoint, "--prefix", etcd_prefix, "--seed", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = kill.communicate(timeout=60)
    actions = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert kill.returncode == 0 and [a["action"] for a in actions] == ["kill"], out + err

    with get_runner() as runner:
        deadline = time.monotonic() + 240
        status = runner.status(handle)
        while status is not None and not status.is_terminal() and time.monotonic() < deadline:
            time.sleep(1)
            status = runner.status(handle)
        assert status is not None and status.state == AppState.SUCCEEDED, \
            f"{status}\n{job_state(etcd_client, job)}\n{diag()}"
        assert status.num_restarts >= 1, status
        assert job in {app.app_id for app in runner.list("marind")}
        lines = list(runner.log_lines(handle, "train", k=0))          # node a's logs (MARIND_STATE_DIR)
        starts = [int(m.group(1)) for line in lines if (m := re.search(r"starts at step (\d+)", line))]
        assert len(starts) >= 2 and starts[0] == 0 and starts[-1] > 0, "".join(lines[-40:])   # resumed after the kill
        desc = runner.describe(handle)
        assert desc is not None and desc.roles[0].args[:1] == ["train.py"]

    logs = _torchx(["log", handle], work, cli_env)
    assert logs.returncode == 0 and "starts at step" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
    assert (work / "step.txt").read_text() == "24"


def test_pending_app_is_described_cancelled_and_deleted(tmp_path, etcd, etcd_client, etcd_prefix, monkeypatch):
    """No agent: the app stays PENDING until TorchX cancels it; delete removes the job's keys."""
    from torchx.schedulers.api import Stream

    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "no-agent"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    with get_runner() as runner:
        cfg = {"etcd": [etcd.endpoint], "prefix": etcd_prefix}
        handle = runner.run_component("dist.torchrun", ["-j", "1:2x1", "--script", "train.py"], "marind", cfg=cfg)
        job = handle.rsplit("/", 1)[-1]
        assert handle.startswith("marind://") and job_state(etcd_client, job)["state"] == "PENDING"
        status = runner.status(handle)
        assert status is not None and status.state == AppState.PENDING and status.num_restarts == 0
        scheduler = runner._scheduler("marind")
        desc = scheduler.describe(job)
        assert desc.roles[0].min_replicas == 1 and desc.roles[0].num_replicas == 2
        assert [(a.app_id, a.state) for a in scheduler.list() if a.app_id == job] == [(job, AppState.PENDING)]
        for bad in ({"streams": Stream.STDERR}, {}):
            try:
                list(runner.log_lines(handle, "train", **bad))
            except ValueError as exc:
                assert "\n" not in str(exc) and ("stdout and stderr in one log" in str(exc) or "no logs" in str(exc))
            else:
                raise AssertionError(f"log_lines {bad} should refuse")
        runner.cancel(handle)
        assert runner.status(handle).state == AppState.CANCELLED
        events = etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/").values()
        assert [e["kind"] for e in events] == ["cancelled"] and "(torchx)" in next(iter(events))["node"]
        runner.delete(handle)
        assert runner.status(handle) is None and scheduler.describe(job) is None

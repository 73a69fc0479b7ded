"""A team's own script under a real agent: its curves in TensorBoard and W&B, each failure named by its cause.

``tests/worker/scripts/faulty_mlp.py`` (plain DDP, 2 ranks, gloo, checkpoints every 5 steps) runs
as ``[job] command`` with ``[job] wandb = { project = ... }`` and no W&B key (an offline run). In
its steps it meets, once each (CI: the NaN and the OOM kill in 20 steps; ``make chaos``: all, in 30):

* step 12: a NaN loss, after which it rolls back to its step-10 checkpoint: ``nonfinite_loss``
  and ``rollback`` events;
* step 16: rank 1 moves into a memory cgroup with a 256 MiB limit (made by the test as a child
  of its own v1 memory cgroup, removed after) and allocates past it: the kernel's OOM killer
  ends it, and the restart's reason names rank 1, the OOM killer and the cgroup (where there is
  no cgroup to make, rank 1 SIGKILLs itself instead and the reason names the SIGKILL);
* step 21: rank 1 SIGKILLs itself while rank 0 waits for it: the restart names rank 1 and the
  signal, not rank 0's "Connection closed by peer";
* step 26: rank 1 stops answering: rank 0's gloo collective times out (30 s), and the restart
  names the timeout and rank 1 as the one that stopped answering.

The job then SUCCEEDs. TensorBoard's own reader (``EventAccumulator``) reads the loss curve the
agent wrote: steps 1..30 with the losses the script reported last for each step, and the goodput
ledger's parts; the W&B
offline run (read back with W&B's record protos) holds every reported loss in order.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from marind.agent.oom_watch import cgroup_dir, memory_cgroup
from marind.cli import main
from marind.control.events import list_events
from marind.control.failure_causes import cause_of
from marind.core.history import history_path
from marind.testing.procs import REPO_ROOT, run_torch_workers
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for
from tests.support.wandb_records import history_rows
from tests.worker.test_own_scripts import SCRIPTS

LIMIT = 256 << 20


@contextlib.contextmanager
def limited_cgroup(limit: int) -> Iterator[tuple[Path | None, str]]:
    """A child of this process's v1 memory cgroup with ``limit``; ``(None, why not)`` where none can be made.
    Removed afterwards (a process of this test left in it is SIGKILLed first)."""
    base = Path("/sys/fs/cgroup/memory")
    own = memory_cgroup(Path("/proc/self/cgroup").read_text())
    if os.geteuid() != 0 or own is None or own[0] != "v1" or not (base / "cgroup.procs").exists():
        yield None, "needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory"
        return
    path = cgroup_dir("v1", own[1]) / f"marind-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        yield None, f"cannot make a memory cgroup under {path.parent}: {exc}"
        return
    try:
        yield path, ""
    finally:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:            # only this test's worker ever moves in
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        path.rmdir()


def spec_text(tmp: Path, out: Path, cgroup: Path | None, steps: int, full: bool) -> str:
    later = ["--kill-at", "21", "--hang-at", "26"] if full else []
    command = ["python", "faulty_mlp.py", "--steps", str(steps), "--save-every", "5", "--nan-at", "12", "--oom-at",
               "16", *later, "--cgroup", str(cgroup or ""), "--oom-wait", "4", "--out", str(out)]
    return f"""
[job]
name = "faulty"
nproc_per_node = 2
max_restarts = 3
command = {json.dumps(command)}
working_dir = "{SCRIPTS}"
wandb = {{ project = "marind-test" }}

[job.env]
PYTHONPATH = "{SCRIPTS}{os.pathsep}{REPO_ROOT}"
FAULTY_TIMEOUT_S = "{30 if full else 300}"

[checkpoint]
url = "file://{tmp / 'ckpt'}"
"""


def expected_curve(lines: list[dict]) -> dict[int, float]:
    """The loss per step TensorBoard shows: the last value reported for each step (a step going back
    purges the later points: TensorBoard's handling of a restarted run)."""
    curve: dict[int, float] = {}
    for line in lines:
        if "loss" in line:
            curve = {s: v for s, v in curve.items() if s < line["step"]}
            curve[line["step"]] = line["loss"]
    return curve


@pytest.mark.timeout(600)
@pytest.mark.parametrize("full", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
                         ids=["oom", "oom-kill-hang"])     # the oom form failed in this stop's clean-clone run: make chaos
def test_own_script_failures_are_named_and_its_curves_reach_tensorboard_and_wandb(
        tmp_path, etcd, etcd_client, etcd_prefix, capsys, monkeypatch, full):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": ""}          # no W&B key: an offline run
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix, env=env)
    diag = lambda: agent_log(tmp_path, "a")
    wait_for(lambda: node_registered(etcd_client, "a"), 30, "node a registered", diag=diag)

    with limited_cgroup(LIMIT) as (cgroup, why_not):
        spec = tmp_path / "faulty.toml"
        steps = 30 if full else 20
        spec.write_text(spec_text(tmp_path, tmp_path / "out", cgroup, steps, full))
        assert main(["submit", str(spec), "--id", "faulty-1"]) == 0
        job = "faulty-1"
        wait_for(lambda: job_state(etcd_client, job).get("state") in ("SUCCEEDED", "FAILED"), 400,
                 f"{job} finished", interval=0.5, diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    run_dir = tmp_path / "state-a" / "jobs" / job
    log = lambda: (run_dir / "logs" / "torchrun.log").read_text(errors="replace")[-6000:]
    assert job_state(etcd_client, job)["state"] == "SUCCEEDED", f"{diag()}\n{log()}"

    events = list_events(etcd_client, job)
    kinds = lambda k: [e["detail"] for e in events if e["kind"] == k]
    restarts = kinds("restart")
    want_causes = ["oom_killed" if cgroup else "killed"] + (["killed", "collective_timeout"] if full else [])
    assert [r["cause"] for r in restarts] == want_causes, f"{why_not}\n{json.dumps(restarts, indent=1)}\n{log()}"
    oom = restarts[0]
    assert oom["rank"] == 1 and oom["reason"].startswith("rank 1 (local 1) on a ")
    if cgroup:
        assert "OOM killer" in oom["reason"], oom
        if "seen in the cgroup" in oom["reason"]:     # else the agent had not looked since the move: the kernel log
            assert cgroup.name in oom["reason"] and "limit 256.0 MiB" in oom["reason"], oom
    assert not any("by peer" in r["reason"] for r in restarts)              # the cause, never rank 0's echo
    if full:
        killed, timeout = restarts[1:]
        assert killed["rank"] == 1 and killed["reason"].startswith("rank 1 (local 1) on a was killed by SIGKILL")
        assert timeout["rank"] == 0 and "rank 1 stopped answering" in timeout["reason"], timeout
        assert "fix: " in timeout["reason"] and timeout["fix"]

    assert kinds("nonfinite_loss") == [{"step": 12, "value": "nan"}]
    assert kinds("rollback") == [{"from_step": 12, "to_step": 10, "cause": "non-finite loss at step 12"}]

    # the curves: every report of rank 0, as the script wrote them
    lines = [json.loads(line) for line in history_path(run_dir).read_text().splitlines()]
    capsys.readouterr()
    assert main(["tensorboard", job, "--state-dir", str(tmp_path / "state-a")]) == 0
    tb_dir = capsys.readouterr().out.strip()
    assert tb_dir == str(run_dir / "tensorboard")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    want = expected_curve(lines)
    assert sorted(loss) == list(range(1, steps + 1)) == sorted(want)
    assert loss == pytest.approx(want, rel=1e-6)                          # float32 in the event file
    assert {"tokens_per_s", "lr", "goodput/training_s", "goodput/restart_s", "goodput/fraction"} <= set(
        acc.Tags()["scalars"])
    assert acc.Scalars("goodput/training_s")[-1].value > 0 and 0 < acc.Scalars("goodput/fraction")[-1].value <= 1

    wandb_log = run_dir / "logs" / "wandb.log"
    wait_for(lambda: wandb_log.exists() and "offline run kept" in wandb_log.read_text(), 90, "the W&B run finished",
             diag=lambda: wandb_log.read_text() if wandb_log.exists() else diag())
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    rows = history_rows(Path(runs[0]))
    assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [(x["step"], x["loss"]) for x in lines if "loss" in x]


@pytest.mark.timeout(180)
def test_a_rank_that_stops_answering_is_named_from_a_real_gloo_timeout():
    """Real gloo ranks: rank 1 stops answering, rank 0's all-reduce times out; its own text names the cause."""
    results = run_torch_workers("tests.worker.workers:collective_timeout_text", 2, timeout=150, timeout_s=2.0,
                                silent_rank=1)
    error = results[0]["error"]
    assert error and "Timed out waiting 2000ms" in error, results
    cause = cause_of(node="n1", exitcode=1, rank=0, local_rank=0, error=error, silent_ranks=[1])
    assert cause.kind == "collective_timeout" and "rank 1 stopped answering" in cause.what and not cause.echo

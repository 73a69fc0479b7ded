"""Real ``torchrun --rdzv-backend=etcd3`` agents on one machine, each its own "node".

Workers (``rank_worker.py``) record RANK/WORLD_SIZE per round and keep
all-reducing over gloo until the test writes the world size they should
finish in to ``OUTDIR/finish``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from marind.testing.procs import kill_group, spawn

WORKER = Path(__file__).with_name("rank_worker.py")
# short keep-alives: a lost node is dropped after ~6 s (torch: 5 s x 3). Shorter ones make
# nodes on a busy 2-core machine look dead now and then, and the group restarts needlessly.
FAST_CONF = "last_call_timeout=2,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=6"


@pytest.fixture
def dirs(tmp_path):
    """(outdir, logs); afterwards, kill any worker a failed test left behind (own sessions)."""
    outdir, logs = tmp_path / "out", tmp_path / "logs"
    outdir.mkdir()
    logs.mkdir()
    yield outdir, logs
    for record in _records(outdir):
        try:
            proc = psutil.Process(record["pid"])
            if str(WORKER) in " ".join(proc.cmdline()):
                proc.kill()
        except (psutil.Error, KeyError):
            pass


def _agent(etcd, run_id: str, nnodes: str, outdir: Path, logs: Path, name: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcd3",
           f"--rdzv-endpoint=127.0.0.1:{etcd.client_port}", f"--rdzv-id={run_id}",
           f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=3",
           "--monitor-interval=0.5", f"--rdzv-conf={FAST_CONF}", str(WORKER), str(outdir)]
    log = open(logs / f"{name}.log", "wb")
    proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env={"RDZV_TEST_DEADLINE_S": "120"})
    log.close()
    return proc


def _records(outdir: Path) -> list[dict]:
    out = []
    for path in outdir.glob("a*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except ValueError:
            continue  # being written
    return out


def _world(records: list[dict], size: int) -> list[dict] | None:
    """The records of one complete round of ``size`` workers (same store port), if any."""
    by_round: dict = {}
    for r in records:
        if int(r["WORLD_SIZE"]) == size:
            by_round.setdefault(r["MASTER_PORT"], {})[int(r["RANK"])] = r
    for ranks in by_round.values():
        if sorted(ranks) == list(range(size)):
            return [ranks[i] for i in range(size)]
    return None


def _wait_world(outdir: Path, size: int, agents, logs: Path, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _world(_records(outdir), size)
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"no complete round of {size} workers within {timeout}s\n{_tails(logs)}")


def _wait_exit(agents, logs: Path, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in agents:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"torchrun {proc.pid} still running\n{_tails(logs)}") from None
    return codes


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a torchrun and its workers, as losing the machine would.

    torchrun starts each worker in a session of its own, so its process
    group alone would leave the workers running as orphans.
    """
    workers = psutil.Process(agent.pid).children(recursive=True)
    kill_group(agent)
    for worker in workers:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    agent.wait(10)
    psutil.wait_procs(workers, timeout=10)


def _tails(logs: Path) -> str:
    parts = []
    for path in sorted(logs.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        parts.append(f"--- {path.name} ---\n" + "\n".join(lines[-25:]))
    return "\n".join(parts)


def test_agents_join_with_contiguous_ranks_and_a_late_node_joins_the_next_round(etcd, dirs):
    outdir, logs = dirs
    first = [_agent(etcd, "late-join", "1:4", outdir, logs, f"node{i}") for i in range(2)]
    round1 = _wait_world(outdir, 2, first, logs)
    assert sorted(int(r["RANK"]) for r in round1) == [0, 1]
    assert len({r["agent_pid"] for r in round1}) == 2  # one worker per agent

    # a third node arrives while the group runs: it waits, the group restarts, all three join
    late = _agent(etcd, "late-join", "1:4", outdir, logs, "node-late")
    (outdir / "finish").write_text("3")
    round2 = _wait_world(outdir, 3, first + [late], logs)
    assert sorted(int(r["RANK"]) for r in round2) == [0, 1, 2]
    assert {r["agent_pid"] for r in round2} == {p.pid for p in first + [late]}
    assert {r["GROUP_WORLD_SIZE"] for r in round2} == {"3"}
    assert _wait_exit(first + [late], logs) == [0, 0, 0], _tails(logs)


def test_killed_node_is_dropped_and_survivors_re_rendezvous(etcd, dirs):
    outdir, logs = dirs
    agents = [_agent(etcd, "node-loss", "2:3", outdir, logs, f"node{i}") for i in range(3)]
    full = _wait_world(outdir, 3, agents, logs)
    # kill the node hosting rank 0 (and the workers' TCPStore): the hardest one to lose
    victim = next(p for p in agents if p.pid == full[0]["agent_pid"])
    _kill_node(victim)
    survivors = [p for p in agents if p is not victim]
    (outdir / "finish").write_text("2")
    after = _wait_world(outdir, 2, survivors, logs)
    assert sorted(int(r["RANK"]) for r in after) == [0, 1]
    assert {r["agent_pid"] for r in after} == {p.pid for p in survivors}
    assert _wait_exit(survivors, logs) == [0, 0], _tails(logs)

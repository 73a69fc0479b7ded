"""Replica groups as real processes for the torchft tests: one torchrun per group and node.

A one-node group is a standalone torchrun; a group of several nodes is one torchrun per
node meeting in an etcd3 rendezvous ``rg-{group}`` (as ``marind agent`` starts them).
Each group's run dir (``MARIND_RUN_DIR``, shared by its nodes here) holds its workers'
progress records (``progress/rank-{rank}.json``, with the torchft fields) and, when a
coordinator publishes one, ``ft/lighthouse.json``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from marind.core.jsonfile import read_json_object
from marind.core.progress import record_path
from marind.testing.procs import kill_group, spawn

_torchruns: list[subprocess.Popen] = []
#: the lighthouse settings of the tests' lighthouse fixture (tests/torchft/conftest.py)
FAULT = {"min_replicas": 1, "join_timeout": 0.5, "heartbeat_timeout": 2.0}


def ft_spec(tmp: Path, *, steps: int, groups: int = 2, min_replicas: int = 1, ckpt: str = "",
            every_steps: int = 0, nproc: int = 1, nodes_per_group: int = 1, max_restarts: int = 3,
            timeout: str = "10s", fault_extra: str = "") -> Path:
    from marind.trainer.data.corpus import write_example_dataset

    data = tmp / "data"
    if not data.with_suffix(".bin").exists():
        write_example_dataset(data, n_docs=120)
    path = tmp / "ft.toml"
    path.write_text(f"""
[job]
name = "ftjob"
nodes = "1:{groups * nodes_per_group}"
nproc_per_node = {nproc}
max_restarts = {max_restarts}
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = {2 * nproc * nodes_per_group}
micro_batch = 2
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {steps}
log_every = 10
[checkpoint]
url = "{ckpt}"
every_steps = {every_steps}
[fault]
mode = "torchft"
replica_groups = {groups}
nodes_per_group = {nodes_per_group}
min_replicas = {min_replicas}
timeout = "{timeout}"
quorum_timeout = "20s"
join_timeout = "500ms"
heartbeat_timeout = "2s"
{fault_extra}
""")
    return path


def run_dir(tmp: Path, group: int) -> Path:
    return tmp / f"rg{group}"


def start_group(tmp: Path, group: int, spec: Path, *, lighthouse: str | None = None, nproc: int = 1,
                nodes: int = 1, rdzv: tuple[str, str] | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start replica group ``group``; returns its first node's torchrun (all are killed at teardown).

    With ``rdzv`` = (etcd endpoint, key prefix) the group's nodes meet in an etcd3 rendezvous, as
    under ``marind agent`` (a fresh store each round); ``nodes`` > 1 needs it.
    """
    env = {"MARIND_REPLICA_GROUP": group, "MARIND_RUN_DIR": run_dir(tmp, group), "MARIND_LOG_JSON": "1", **(env or {})}
    if lighthouse:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
    run_dir(tmp, group).mkdir(parents=True, exist_ok=True)
    if rdzv is None:
        assert nodes == 1, "a group of several nodes needs rdzv=(etcd endpoint, prefix)"
        meet = ["--standalone"]    # its store outlives a restart: restarted workers may dial dead peers
    else:
        endpoint, prefix = rdzv
        meet = ["--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint.split('://', 1)[-1]}", f"--rdzv-id=rg-{group}",
                f"--rdzv-conf=prefix={prefix}", f"--nnodes={nodes}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *meet, "--max-restarts=3",
           "--monitor-interval=0.5", f"--nproc-per-node={nproc}", "-m", "marind.trainer", str(spec)]
    first = None
    for _ in range(nodes):
        with open(tmp / f"rg{group}.log", "ab") as log:
            proc = spawn(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        _torchruns.append(proc)
        first = first or proc
    return first


def kill_torchrun(proc: subprocess.Popen) -> None:
    """SIGKILL a group: torchrun's session and its workers (torchrun gives each worker its own session)."""
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        workers = []
    kill_group(proc)
    for w in workers:
        try:
            w.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(workers, timeout=5)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def signal_group(proc: subprocess.Popen, sig: int) -> list[int]:
    """Send ``sig`` to a group's torchrun and every process under it (SIGSTOP: a host gone silent).

    Returns:
        The pids signalled.
    """
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return []
    sent = []
    for p in procs:
        try:
            p.send_signal(sig)
            sent.append(p.pid)
        except psutil.Error:
            pass
    return sent


def kill_all_groups() -> None:
    while _torchruns:
        kill_torchrun(_torchruns.pop())


def progress(tmp: Path, group: int, rank: int = 0) -> dict:
    """The JSON object of a rank's progress record (``{}`` until it has written one)."""
    return read_json_object(record_path(run_dir(tmp, group), rank)) or {}


def wait_for(pred, timeout: float, what: str, tmp: Path | None = None, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{logs(tmp)}" if tmp else ""))


def logs(tmp: Path, tail: int = 3000) -> str:
    out = []
    for path in sorted(tmp.glob("rg*.log")):
        out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
    return "\n".join(out)

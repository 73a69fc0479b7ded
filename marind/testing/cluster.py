"""What the daemon benchmarks share: agents as subprocesses, submit, data, a process tree's end.

Every process is started in its own session and ended by the benchmark
that started it (``stop_agent`` / ``kill_tree``), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# short rendezvous timeouts: no waiting for extra nodes, node loss noticed in ~3 s
FAST_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def env(extra: dict | None = None) -> dict:
    """The environment of an agent or CLI child: this one, the repository on PYTHONPATH, JSON logs."""
    out = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MARIND_LOG_JSON="1")
    out.pop("NOTIFY_SOCKET", None)
    out.update(extra or {})
    return out


def make_data(root: Path, n_docs: int = 60) -> str:
    """Write the example dataset (``n_docs`` documents) under ``root/data``; its prefix."""
    from marind.trainer.data import corpus
    prefix = root / "data" / "corpus"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_example_dataset(prefix, n_docs)
    return str(prefix)


def start_agent(root: Path, node: str, etcd: str, prefix: str, *, fast: bool = True,
                slots: int = 2, metrics_port: int = 0, extra_env: dict | None = None) -> subprocess.Popen:
    """An agent subprocess; ``fast``: short rendezvous timeouts and reports; ``metrics_port``: 0 off,
    -1 any free port (written to ``root/state-{node}/metrics.port``; the job page is served there);
    ``extra_env``: more of the agent's (and so its workers') environment."""
    log = open(root / f"agent-{node}.log", "ab")
    extra = {"MARIND_RDZV_CONF": FAST_RDZV, "MARIND_REPORT_INTERVAL": "0.5"} if fast else {}
    extra.update(extra_env or {})
    try:
        return subprocess.Popen([sys.executable, "-m", "marind", "agent", "--node", node, "--etcd", etcd,
                                 "--state-dir", str(root / f"state-{node}"), "--slots", str(slots),
                                 "--metrics-port", str(metrics_port)],
                                env=env({"MARIND_PREFIX": prefix, **extra}),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    finally:
        log.close()


def start_nodes(root: Path, names: list[str], etcd: str, prefix: str, timeout: float = 60.0
                ) -> list[subprocess.Popen]:
    """One agent per node name; returns once every one has registered in etcd. Stops the ones it
    started when it does not return them (the wait timed out, or a signal ended it: the caller
    has nothing to stop)."""
    import time

    from marind.core.etcd_client import EtcdClient
    agents: list[subprocess.Popen] = []
    try:
        for n in names:
            agents.append(start_agent(root, n, etcd, prefix))
        with EtcdClient(etcd, prefix=prefix) as client:
            deadline = time.time() + timeout
            while len(client.get_prefix_keys(client.key("nodes") + "/")) < len(names):
                if time.time() > deadline:
                    raise RuntimeError(f"the agents did not register within {timeout:.0f} s")
                time.sleep(0.2)
    except BaseException:
        for agent in agents:
            stop_agent(agent)
        raise
    return agents


def marind(args: list[str], etcd: str, prefix: str, timeout: float = 900) -> str:
    """Run ``marind ARGS`` against this etcd; its stdout, or RuntimeError with its stderr."""
    res = subprocess.run([sys.executable, "-m", "marind", *args],
                         env=env({"MARIND_ETCD": etcd, "MARIND_PREFIX": prefix}), capture_output=True,
                         text=True, timeout=timeout, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"marind {args[0]} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def submit(spec: Path, etcd: str, prefix: str, wait: bool) -> str:
    """``marind submit SPEC`` (``--wait`` if asked); the job id (the last stdout line)."""
    out = marind(["submit", str(spec), *(["--wait"] if wait else [])], etcd, prefix)
    return out.strip().splitlines()[-1]


def kill_tree(proc: subprocess.Popen | int) -> None:
    """SIGKILL a process and every descendant, and reap them (10 s at most)."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def stop_agent(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the agent stops its jobs' workers), then the whole tree if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_tree(proc)

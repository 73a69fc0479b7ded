"""The one process-spawning helper for tests and benchmarks.

* ``spawn(cmd, ...)`` starts a child in its own session (process group) and
  registers it so that ``kill_all()`` (called by the test fixtures, even
  when a test fails) SIGKILLs the whole group.
* ``run_torch_workers(target, world_size, **kwargs)`` runs ``target`` (a
  ``"module:function"`` string) in N real processes that form a gloo
  process group on loopback, and returns each rank's JSON result. A
  worker that fails, or a run past ``timeout``, raises ``WorkersFailed``
  with the tail of every rank's output; all process groups are killed.
* ``exit_on_sigterm()``: a bench's SIGTERM raises ``SystemExit(143)``, so the
  ``finally`` blocks that stop its servers and remove its bed run (SIGTERM's
  default kills at once; SIGINT is ignored in a shell's background job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from marind.core.netutil import free_port

#: the directory that holds the ``marind`` package: the repository in a source checkout, where
#: children start (``cwd``) and what they find first on ``PYTHONPATH``
REPO_ROOT = Path(__file__).resolve().parents[2]
_live: list[subprocess.Popen] = []


class WorkersFailed(RuntimeError):
    """A rank of ``run_torch_workers`` failed or the run timed out; the message has every rank's tail."""


def base_env(extra: dict | None = None) -> dict:
    """The environment of a child: this one, ``REPO_ROOT`` first on ``PYTHONPATH``, one OMP thread,
    JSON logs, no ``NOTIFY_SOCKET``.

    Args:
        extra: variables set on top (values turned into strings).

    Returns:
        A new dict.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MARIND_LOG_JSON", "1")
    env.pop("NOTIFY_SOCKET", None)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit(143)`` in the main thread (module doc)."""
    def _exit(_signum: int, _frame: object) -> None:
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, _exit)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process, not a zombie; one that ends while being looked at is not
    (no race between an existence check and a status read)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def spawn(cmd: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None,
          stdout=None, stderr=None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in a new session; it is killed by ``kill_all()``."""
    proc = subprocess.Popen(cmd, env=base_env(env), cwd=cwd or REPO_ROOT,
                            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)
    _live.append(proc)
    return proc


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s process group; a group already gone is not an error."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> None:
    """SIGKILL the process group of every child ``spawn`` started that is still registered."""
    while _live:
        proc = _live.pop()
        kill_group(proc)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def run_torch_workers(target: str, world_size: int, *, timeout: float = 120.0,
                      env: dict | None = None, **kwargs) -> list:
    """Run ``target(**kwargs)`` on ``world_size`` gloo ranks; return [result of rank 0, ...]."""
    workdir = Path(tempfile.mkdtemp(prefix="marind-workers-"))
    port = free_port()
    procs = []
    logs = []
    args_path = workdir / "args.json"
    args_path.write_text(json.dumps(kwargs))
    for rank in range(world_size):
        log_path = workdir / f"rank{rank}.log"
        logs.append(log_path)
        fh = open(log_path, "wb")
        rank_env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size,
                    "LOCAL_WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port, **(env or {})}
        procs.append(spawn([sys.executable, "-m", "marind.testing.worker_main", target,
                            str(args_path), str(workdir / f"result{rank}.json")],
                           env=rank_env, stdout=fh, stderr=subprocess.STDOUT))
        fh.close()
    deadline = time.monotonic() + timeout
    failed = None
    try:
        pending = set(range(world_size))
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                rc = procs[rank].poll()
                if rc is None:
                    continue
                pending.discard(rank)
                if rc != 0 and failed is None:
                    failed = f"rank {rank} exited with {rc}"
            if failed:
                # give the others a moment to report their own error, then stop them
                time.sleep(1.0)
                break
            time.sleep(0.05)
        if pending and not failed:
            failed = f"timeout after {timeout}s (ranks still running: {sorted(pending)})"
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait(5)
            if proc in _live:
                _live.remove(proc)
    try:
        if failed:
            tails = "\n".join(f"--- rank {r} ---\n{_tail(p)}" for r, p in enumerate(logs))
            raise WorkersFailed(f"{failed}\n{tails}")
        return [json.loads((workdir / f"result{r}.json").read_text()) for r in range(world_size)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)    # the ranks' logs (their tails are in a failure)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"

"""One torchrun per job on this node: its process tree, workers, stop, and leftovers.

The run dir is ``{state_dir}/jobs/{job}/``: ``run.toml`` (the validated
spec, written by ``marind.agent.torchrun_args``), ``logs/torchrun.log``
(torchrun's and the workers' output, through a relay process: ``output_relay``;
a full disk drops output there, never fails a write of torchrun's), ``progress/``
(the workers' records) and ``pids.json`` (torchrun's and the workers' pids with
their start times).

torchrun runs in its own session with ``PR_SET_PDEATHSIG = SIGTERM`` (set by a shim):
if the agent dies, torchrun is told to stop and stops its workers. When
an agent starts it reaps leftovers of a previous incarnation from
``pids.json`` (``reap_leftovers``): marind chooses clean restart over
adoption; the job's survivors re-rendezvous and this node joins the next
round.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from marind.agent.output_relay import OutputRelay
from marind.agent.warm_start.zygote import read_pid_map
from marind.core import workerenv as WE
from marind.core.disk import is_disk_full
from marind.core.jsonfile import write_json_atomic
from marind.core.log import get_logger

PR_SET_PDEATHSIG = 1
#: how long torchrun's exit waits for its relay to put the last output into the log
DRAIN_S = 2.0


# Sets PR_SET_PDEATHSIG in the child, then execs torchrun (same pid; the setting survives exec).
# A shim rather than ``preexec_fn``: a preexec_fn forces fork() in a process with gRPC threads,
# whose fork handlers sometimes abort the child; without it subprocess uses vfork.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    f"    ctypes.CDLL('libc.so.6', use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0)\n"
    "except OSError:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)  # the agent is already gone\n"
    f"z = os.environ.get('{WE.ZYGOTE_SOCKET}')\n"
    "if z:  # warm starts: the zygote becomes torchrun's child (marind/agent/warm_start/zygote.py)\n"
    "    me = os.getpid()\n"
    "    if os.fork() == 0:\n"
    "        os.execv(sys.executable, [sys.executable, '-m', 'marind.agent.warm_start.zygote', z,\n"
    f"                 os.environ['{WE.ZYGOTE_PIDS}'], os.environ['{WE.ZYGOTE_PRELOAD}'], str(me)])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class WorkerProc:
    """One worker of torchrun's current round, as seen from this node."""

    pid: int                      # the worker itself (signal this one)
    rank: int | None
    local_rank: int | None
    launcher: int | None = None   # torchrun's child: the worker, or its zygote stub (one per generation)

    @property
    def launched_by(self) -> int:
        """torchrun's child that stands for this worker (its stub on a warm start)."""
        return self.launcher if self.launcher is not None else self.pid


def _rank_env(proc: psutil.Process) -> tuple[int | None, int | None]:
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return None, None

    def num(name):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            return None
    return num("RANK"), num("LOCAL_RANK")


@dataclass
class TorchrunSupervisor:
    """One torchrun on this node: started in its own session, watched, stopped.

    Args:
        job: the job's id.
        run_dir: the job's run dir (logs, ``pids.json``).
        command: torchrun's argv (``torchrun_command``).
        env: its environment (``worker_env``).
        on_disk_full: told ``(what, path, error)`` when a write into the run dir found the disk full
            (the agent's state-dir watch); None: logged.
    """

    job: str
    run_dir: Path
    command: list[str]
    env: dict
    on_disk_full: Callable[[str, Path, OSError], object] | None = None
    proc: subprocess.Popen | None = None
    stopping: bool = False
    started_at: float = 0.0
    _workers: dict[int, WorkerProc] = field(default_factory=dict)
    _stubs: dict[int, WorkerProc] = field(default_factory=dict)     # torchrun's children, by pid
    _relay: OutputRelay | None = None
    _exited_at: float | None = None       # when poll() first saw torchrun gone (its relay drains)

    def __post_init__(self):
        self.log = get_logger(__name__, job=self.job)

    @property
    def log_path(self) -> Path:
        """``logs/torchrun.log``: torchrun's and the workers' output."""
        return self.run_dir / "logs" / "torchrun.log"

    def start(self) -> None:
        """Start torchrun behind the PDEATHSIG shim, its output appended to ``logs/torchrun.log`` by a
        relay (``output_relay``; where no relay can start, torchrun writes the file itself)."""
        header = f"--- marind: starting torchrun at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode()
        shim = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid())]
        try:
            self._relay = OutputRelay.start(self.log_path)
            out = self._relay.fd
        except OSError as exc:
            self.log.warning("output_relay_failed", error=str(exc), action="torchrun writes its log itself")
            out = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            try:
                os.write(out, header)
            except OSError:
                pass                      # a full disk, or the relay gone already: torchrun's own output tells
            self.proc = subprocess.Popen([*shim, *self.command], env=self.env, cwd=self.run_dir, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if self._relay is not None:
                self._relay.handed_over()
            else:
                os.close(out)
        self.started_at = time.time()
        self._save_pids()
        self.log.info("torchrun_started", pid=self.proc.pid, command=" ".join(self.command))

    @property
    def pid(self) -> int | None:
        """torchrun's pid (None before ``start``)."""
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        """torchrun's exit code once it exited and its output is in the log (its relay ended, or
        ``DRAIN_S`` passed); None while it runs (or before ``start``). Hands the relay's word of a
        full disk to ``on_disk_full``."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        relay = self._relay
        if relay is None:
            return rc
        for status in relay.statuses():
            if status.get("event") == "full":
                code = getattr(errno, str(status.get("errno")), errno.EIO)
                self._disk_error("torchrun output", self.log_path, OSError(code, str(status.get("error"))))
        if rc is None or relay.done():
            return rc
        now = time.monotonic()
        self._exited_at = self._exited_at if self._exited_at is not None else now
        return rc if now - self._exited_at >= DRAIN_S else None

    def _disk_error(self, what: str, path: Path, exc: OSError) -> None:
        """A write into the run dir failed: a full disk is the state-dir watch's to say (once); anything
        else is logged here."""
        if not (self.on_disk_full is not None and is_disk_full(exc) and self.on_disk_full(what, path, exc)):
            self.log.warning("run_dir_write_failed", what=what, path=str(path), error=str(exc))

    def workers(self) -> list[WorkerProc]:
        """torchrun's live worker children, with their ranks from their environment."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []
        out = []
        forked = read_pid_map(self.env[WE.ZYGOTE_PIDS]) if WE.ZYGOTE_PIDS in self.env else {}
        for child in children:
            known = self._stubs.get(child.pid)
            if known is None or known.rank is None:
                rank, local_rank = _rank_env(child)
                if rank is None:       # not a worker (no RANK in its environment): the zygote
                    continue
                known = WorkerProc(child.pid, rank, local_rank)
                self._stubs[child.pid] = known
            if child.pid in forked:    # a warm start: the worker is the zygote's child
                known = WorkerProc(forked[child.pid], known.rank, known.local_rank, launcher=child.pid)
                self._stubs[child.pid] = known
            elif known.launcher is not None:
                continue               # its forked worker has ended; the stub is on its way out
            out.append(known)
        alive = {c.pid for c in children}
        self._stubs = {pid: w for pid, w in self._stubs.items() if pid in alive}
        if {w.pid for w in out} != set(self._workers):
            self._workers = {w.pid: w for w in out}
            self._save_pids()
        return sorted(out, key=lambda w: (w.rank if w.rank is not None else -1))

    def worker_pids(self) -> list[int]:
        """The workers' pids as last seen by ``workers()``."""
        return list(self._workers)

    def signal_workers(self, sig: int, pids: Iterable[int] | None = None) -> list[int]:
        """Send ``sig`` to the workers.

        Args:
            sig: the signal.
            pids: the workers to signal (default: those last seen by ``workers()``).

        Returns:
            The pids the signal reached.
        """
        sent = []
        for pid in list(self._workers) if pids is None else pids:
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sent

    def kill_now(self) -> list[int]:
        """SIGKILL torchrun's process group, every descendant and the known workers (no SIGTERM).

        Returns:
            The pids signalled.
        """
        pids: set[int] = set(self.worker_pids())
        if self.pid is not None and self.poll() is None:
            try:
                pids |= {p.pid for p in psutil.Process(self.pid).children(recursive=True)}
            except psutil.Error:
                pass
            _killpg(self.pid, signal.SIGKILL)
            pids.add(self.pid)
        killed = []
        for pid in sorted(pids):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        return killed

    def stop(self, timeout: float) -> int | None:
        """SIGTERM torchrun's group and the workers, wait up to ``timeout``, then SIGKILL."""
        self.stopping = True
        if self.proc is None:
            return None
        procs = [*self._workers.values(), *self.workers()]
        worker_pids = {w.pid for w in procs} | {w.launched_by for w in procs}   # workers and their stubs
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
        for pid in worker_pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any(_alive(p) for p in worker_pids):
                break
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.log.warning("torchrun_kill", reason=f"still running {timeout:.0f}s after SIGTERM")
        _killpg(self.proc.pid, signal.SIGKILL)
        for pid in worker_pids:
            _kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self._relay is not None:
            self._relay.close()           # it ends by itself once the last worker is gone
        self._clear_pids()
        return self.proc.returncode

    # -- pids.json: what a restarted agent reaps ----------------------------------------------
    def _save_pids(self) -> None:
        if self.proc is None:
            return
        pids = [self.proc.pid, *self._workers]
        processes: list[dict] = []
        doc = {"torchrun_pid": self.proc.pid, "processes": processes}
        for pid in pids:
            try:
                processes.append({"pid": pid, "create_time": psutil.Process(pid).create_time()})
            except psutil.Error:
                continue
        try:
            write_json_atomic(self.run_dir / "pids.json", doc)
        except OSError as exc:           # a restarted agent could not reap what this file leaves out
            self._disk_error("pids.json", self.run_dir / "pids.json", exc)

    def _clear_pids(self) -> None:
        try:
            (self.run_dir / "pids.json").unlink()
        except FileNotFoundError:
            pass


def reap_leftovers(jobs_dir: Path) -> list[int]:
    """SIGKILL processes a previous agent left (recorded in pids.json and still the same process)."""
    killed = []
    for pid_file in sorted(Path(jobs_dir).glob("*/pids.json")):
        try:
            doc = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            continue
        for item in doc.get("processes", []):
            try:
                proc = psutil.Process(int(item["pid"]))
                if abs(proc.create_time() - float(item["create_time"])) > 0.5:
                    continue            # pid reused by something else
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue            # already dead, waiting for its reaper
                proc.kill()
                killed.append(proc.pid)
            except (psutil.Error, KeyError, ValueError):
                continue
        pid_file.unlink(missing_ok=True)
    return killed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

"""One torchrun per job on this node: run dir, command, process tree, stop.

The run dir is ``{state_dir}/jobs/{job}/``: ``run.toml`` (the validated
spec), ``logs/torchrun.log`` (torchrun's and the workers' output),
``progress/`` (the workers' records) and ``pids.json`` (torchrun's and
the workers' pids with their start times).

torchrun runs in its own session with ``PR_SET_PDEATHSIG = SIGTERM`` (set by a shim):
if the agent dies, torchrun is told to stop and stops its workers. When
an agent starts it reaps leftovers of a previous incarnation from
``pids.json`` (``reap_leftovers``): marind chooses clean restart over
adoption; the job's survivors re-rendezvous and this node joins the next
round.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from marind.core import workerenv as WE
from marind.core.log import get_logger
from marind.core.spec import RunSpec
from marind.zygote import read_pid_map

PR_SET_PDEATHSIG = 1


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
    "if z:  # warm starts: the zygote becomes torchrun's child (marind/zygote.py)\n"
    "    me = os.getpid()\n"
    "    if os.fork() == 0:\n"
    "        os.execv(sys.executable, [sys.executable, '-m', 'marind.zygote', z,\n"
    f"                 os.environ['{WE.ZYGOTE_PIDS}'], os.environ['{WE.ZYGOTE_ENTRYPOINT}'], str(me)])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def spec_to_toml(spec: dict) -> str:
    """The spec dict (``RunSpec.to_dict()``) as run.toml; None values are left out."""
    lines: list[str] = []

    def table(name: str, data: dict) -> None:
        lines.append(f"[{name}]")
        subtables = []
        for key, value in data.items():
            if value is None:
                continue
            if isinstance(value, dict):
                subtables.append((f"{name}.{key}", value))
            else:
                lines.append(f"{json.dumps(key) if not key.replace('_', '').isalnum() else key} = "
                             f"{_toml_value(value)}")
        lines.append("")
        for sub_name, sub in subtables:
            table(sub_name, sub)

    for section, data in spec.items():
        table(section, data)
    return "\n".join(lines)


def torchrun_command(*, python: str, job: str, spec: RunSpec, endpoint: str, prefix: str,
                     run_toml: Path, rdzv_conf: str = "", backend: str = "etcd3",
                     replica_group: int | None = None) -> list[str]:
    """torchrun's command line for this node's part of ``job``.

    Args:
        python: the interpreter that runs torchrun.
        job: the job's id (the rendezvous id of an elastic job).
        spec: the job's spec.
        endpoint: etcd's endpoints, comma-separated (schemes are dropped).
        prefix: the marind key prefix in etcd.
        run_toml: the stored run.toml the entrypoint reads.
        rdzv_conf: extra ``--rdzv-conf`` entries, comma-separated.
        backend: the rendezvous backend.
        replica_group: torchft jobs: the node's replica-group slot.

    Returns:
        The argv.

    Raises:
        ValueError: a torchft job without ``replica_group``.
    """
    j = spec.job
    nodes, run_id = f"{j.nodes[0]}:{j.nodes[1]}", job
    if spec.fault.mode == "torchft":
        if replica_group is None:
            raise ValueError("a torchft job's torchrun needs the node's replica_group")
        # the group's nodes_per_group nodes (marind/agent/ft_coordinator.py) meet in a rendezvous of
        # their own, under the job's keys. Not --standalone: its c10d handler reuses the workers'
        # store across restarts, and restarted workers then dial the dead ones' addresses.
        nodes, run_id = str(spec.fault.nodes_per_group), f"rg-{replica_group}"
        prefix = f"{prefix.rstrip('/')}/jobs/{job}/ft"
    conf = [f"prefix={prefix}"] + [c for c in rdzv_conf.split(",") if c.strip()]
    endpoint = ",".join(e.split("://", 1)[-1] for e in endpoint.split(","))
    rdzv = [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={','.join(conf)}", f"--nnodes={nodes}"]
    return [python, "-m", "torch.distributed.run", *rdzv,
            f"--nproc-per-node={j.nproc_per_node}",
            f"--max-restarts={j.max_restarts}", "--monitor-interval=0.5",
            *(["-m", "marind.zygote_stub"] if j.warm_start else ["-m"]),
            j.entrypoint, str(run_toml)]


def worker_env(base: Mapping[str, str], *, job: str, node: str, run_dir: Path, spec: RunSpec,
               etcd_user: str | None = None, etcd_password: str | None = None) -> dict[str, str]:
    """The environment of a job's torchrun and workers (names in ``marind.core.workerenv``).

    Args:
        base: the agent's environment (systemd's notify variables are dropped).
        job: the job's id.
        node: this node's name.
        run_dir: the job's run dir on this node.
        spec: the job's spec (``job.env`` is added last, ``job.warm_start`` adds the zygote's).
        etcd_user: etcd credentials handed down to the workers.
        etcd_password: etcd credentials handed down to the workers.

    Returns:
        The environment.
    """
    env = dict(base)
    env.pop("NOTIFY_SOCKET", None)          # the workers are not the service
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({WE.RUN_DIR: str(run_dir), WE.JOB_ID: job, WE.NODE: node,
                "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": str(run_dir / "logs" / "error.json")})
    if etcd_user:
        env[WE.ETCD_USER] = etcd_user
    if etcd_password:
        env[WE.ETCD_PASSWORD] = etcd_password
    if spec.job.warm_start:
        env.update(zygote_env(job, run_dir, spec.job.entrypoint))
    for key, value in spec.job.env:
        env[key] = value
    return env


def zygote_env(job: str, run_dir: Path, entrypoint: str) -> dict[str, str]:
    """Where torchrun's zygote listens (an abstract socket of this agent and job) and what it loads.

    Args:
        job: the job's id.
        run_dir: the job's run dir (the zygote's pid map goes there).
        entrypoint: the module the zygote preloads.

    Returns:
        The ``MARIND_ZYGOTE_*`` variables.
    """
    return {WE.ZYGOTE_SOCKET: f"@marind-zygote-{os.getpid()}-{job}",
            WE.ZYGOTE_PIDS: str(run_dir / "zygote.pids.json"),
            WE.ZYGOTE_ENTRYPOINT: entrypoint}


def prepare_run_dir(run_dir: Path, spec: RunSpec) -> Path:
    """Fresh progress dir, logs dir, run.toml.

    Args:
        run_dir: the job's run dir on this node.
        spec: the job's spec, written as run.toml.

    Returns:
        The run.toml path.
    """
    shutil.rmtree(run_dir / "progress", ignore_errors=True)
    (run_dir / "progress").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.toml"
    path.write_text(spec_to_toml(spec.to_dict()))
    return path


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
    """

    job: str
    run_dir: Path
    command: list[str]
    env: dict
    proc: subprocess.Popen | None = None
    stopping: bool = False
    started_at: float = 0.0
    _workers: dict[int, WorkerProc] = field(default_factory=dict)
    _stubs: dict[int, WorkerProc] = field(default_factory=dict)     # torchrun's children, by pid

    def __post_init__(self):
        self.log = get_logger(__name__, job=self.job)

    def start(self) -> None:
        """Start torchrun behind the PDEATHSIG shim, output appended to ``logs/torchrun.log``."""
        log_path = self.run_dir / "logs" / "torchrun.log"
        with open(log_path, "ab") as logf:
            logf.write(f"--- marind: starting torchrun at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                       .encode())
            logf.flush()
            shim = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid())]
            self.proc = subprocess.Popen([*shim, *self.command], env=self.env, cwd=self.run_dir, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.started_at = time.time()
        self._save_pids()
        self.log.info("torchrun_started", pid=self.proc.pid, command=" ".join(self.command))

    @property
    def pid(self) -> int | None:
        """torchrun's pid (None before ``start``)."""
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        """torchrun's exit code, or None while it runs (or before ``start``)."""
        return self.proc.poll() if self.proc else None

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
        tmp = self.run_dir / ".pids.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.run_dir / "pids.json")

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


def default_python() -> str:
    """The interpreter that runs torchrun when the config names none: the agent's own."""
    return sys.executable

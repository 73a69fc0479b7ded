"""A real Slurm cluster on the multi-host bed: a slurmd in every host, slurmctld and munged beside etcd.

    with HostBed(tmp / "bed", ["host1", "host2"], etcd=False) as bed, SlurmBed(bed, tmp / "slurm") as slurm:
        job = slurm.sbatch("host1", ["examples/slurm/marind.sbatch", "run.toml"])
        slurm.wait_job(job, {"COMPLETED"})
        slurm.node("host2")["State"]                     # "IDLE", "DOWN+NOT_RESPONDING", ...

How it runs (Debian's ``slurm-wlm`` 22.05, as root):

* **munged** and **slurmctld** run on the bridge side (the root namespace), like the bed's etcd
  and S3: slurmctld listens on every address and is named ``SlurmctldHost=MACHINE(CONTROL_BRIDGE)``,
  so its own hostname check passes and the hosts reach it over their control link. munge's
  socket is a file under the cluster's directory (``AuthInfo=socket=...``): a path socket is
  reachable from every network namespace, so one munged serves every host.
* **slurmd** runs in each host (``bed.popen``: its hostname, network and ``/etc/hosts``), with
  ``NodeName`` = the host's hostname and ``NodeAddr`` = its control address; spool, pid and log
  files are per node (``%n``). Jobs' processes (slurmstepd, the batch script, srun's tasks)
  are the slurmd's children, so they live in the host too, and ``bed.power_off`` freezes them.
* ``slurm.conf`` is written per cluster under its directory: no cgroups
  (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``), no accounting
  (``AccountingStorageType=accounting_storage/none``, ``JobCompType=jobcomp/none``: a job's end
  state is ``scontrol show job``'s), whole nodes (``select/linear``), ``ReturnToService=2`` and a
  short ``SlurmdTimeout`` so that a silent node is marked DOWN within a scenario.
  Clients find it through ``SLURM_CONF`` (``env()``); ``sbatch`` exports the submitter's
  environment to the job, so the job's tasks find it too.

``close()`` (also on an exception inside ``with``) kills every daemon by its process group,
the slurmds too (the bed's own ``close()`` then sweeps whatever jobs left in the hosts).
``slurm_unavailable()`` says why a machine cannot run it (no binaries, not root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from marind.core.log import get_logger
from marind.core.netutil import free_ports
from marind.testing import hosts_sweep
from marind.testing.hosts import HostBed
from marind.testing.hosts_plan import CONTROL
from marind.testing.procs import kill_group, spawn

__all__ = ["SlurmBed", "SlurmError", "slurm_unavailable", "parse_record"]

log = get_logger("testing.slurm_bed")

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin")
#: the states of a job that will not change any more (``scontrol show job``'s ``JobState``)
FINAL_JOB_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                              "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


class SlurmError(RuntimeError):
    """A Slurm daemon did not come up, or a Slurm command failed (the message says which, with its log)."""


def which(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories (root's PATH may lack ``/usr/sbin``)."""
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def slurm_unavailable() -> str | None:
    """Why Slurm cannot run on the bed here (one line), or None.

    The daemons need root (slurmd starts jobs as their users, munged's key is root's here) and
    the Debian packages ``slurmctld slurmd slurm-client munge`` (``make setup`` installs them as root).
    """
    if os.geteuid() != 0:
        return "Slurm on the bed needs root (slurmd starts jobs as their users)"
    missing = [b for b in BINARIES if which(b) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): `make setup` as root installs "
                "the Debian packages slurmctld slurmd slurm-client munge")
    return None


def parse_record(text: str) -> dict[str, str]:
    """One ``scontrol show job|node`` record as ``{Key: value}``.

    A value runs to the next `` Key=`` (values such as ``Reason=Not responding [slurm@...]`` hold
    spaces); the first occurrence of a key wins.
    """
    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/]*)=", text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out


class SlurmBed:
    """munged, slurmctld and one slurmd per host of a started bed.

    Args:
        bed: the bed (started); every host becomes a node of partition ``bed``.
        root: the cluster's directory (slurm.conf, munge key and socket, state, spool, logs).
        slurmd_timeout: ``SlurmdTimeout``: seconds of silence before slurmctld marks a node DOWN.
        cpus: ``CPUs`` of every node (at most this machine's: slurmd drains a node that has fewer).
    """

    def __init__(self, bed: HostBed, root: str | os.PathLike, *, slurmd_timeout: int = 10, cpus: int | None = None):
        self.bed = bed
        self.root = Path(root)
        self.slurmd_timeout = slurmd_timeout
        self.cpus = cpus or min(os.cpu_count() or 1, 2)
        self.conf = self.root / "slurm.conf"
        self.munge_dir: Path | None = None
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.slurmds: dict[str, subprocess.Popen] = {}
        self._started: list[subprocess.Popen] = []     # every daemon ever started, for ``leftovers``

    # -- building and tearing down ---------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmBed:
        """Write the configuration, start the daemons, wait until every node is IDLE.

        Raises:
            SlurmError: Slurm is unavailable here, or a daemon exited or the nodes did not come up
                within ``timeout`` (the message has the logs' tails); everything started is stopped first.
        """
        reason = slurm_unavailable()
        if reason:
            raise SlurmError(reason)
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        log.info("slurm_started", nodes=self.bed.names, conf=str(self.conf))
        return self

    def _start(self, timeout: float) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        # munged wants every directory above its socket searchable by all (a test's tmp dir is 0700)
        self.munge_dir = Path(tempfile.mkdtemp(prefix="marind-munge-"))
        os.chmod(self.munge_dir, 0o755)
        with self._log("munged.out") as out:
            self.munged = spawn([self._bin("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                                 f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                 f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                 f"--log-file={self.root / 'log' / 'munged.log'}"],
                                stdout=out, stderr=subprocess.STDOUT)
        self._started.append(self.munged)
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket", self.munged, "munged.log")
        ctl_port, slurmd_port = free_ports(2, self._ctl_addr())
        self.conf.write_text(self.config_text(ctl_port, slurmd_port))
        with self._log("slurmctld.out") as out:
            self.slurmctld = spawn([self._bin("slurmctld"), "-D", "-i", "-f", str(self.conf)],
                                   env=self.env(), stdout=out, stderr=subprocess.STDOUT)
        self._started.append(self.slurmctld)
        self._register_servers([self.munged.pid, self.slurmctld.pid])
        self._wait(lambda: self._port_open(ctl_port), timeout, "slurmctld's port", self.slurmctld, "slurmctld.log")
        for name in self.bed.names:
            (self.root / "spool" / name).mkdir(exist_ok=True)
            with self._log(f"slurmd-{name}.out") as out:
                self.slurmds[name] = self.bed.popen(name, self.slurmd_command(name), env=self.env(),
                                                    stdout=out, stderr=subprocess.STDOUT)
            self._started.append(self.slurmds[name])
        self._wait(self._all_idle, timeout, "every node IDLE", self.slurmctld, "slurmctld.log")

    def close(self) -> None:
        """Stop every daemon (by its process group); safe to call twice, and after a failed ``start``."""
        procs = [*self.slurmds.values(), *(p for p in (self.slurmctld, self.munged) if p is not None)]
        for proc in procs:
            kill_group(proc)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                log.warning("slurm_daemon_not_reaped", pid=proc.pid)
        self.slurmds.clear()
        self.slurmctld = self.munged = None
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def __enter__(self) -> SlurmBed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """What of this cluster remains: live daemons (``pid N``), munge's socket directory."""
        out = [f"pid {p.pid}" for p in self._started if p.poll() is None]
        return out + ([str(self.munge_dir)] if self.munge_dir is not None and self.munge_dir.exists() else [])

    def _register_servers(self, pids: list[int]) -> None:
        """Add the bridge-side daemons to the bed's registry entry, so that the next bed built kills them
        if this process dies before ``close()`` (``hosts_sweep.sweep_stale``; slurmds die with the hosts)."""
        plan = self.bed.plan
        if plan is None:
            return
        try:
            doc = json.loads((hosts_sweep.REGISTRY / f"{plan.bed_id}.json").read_text())
            known = [int(s["pid"]) for s in doc.get("servers", [])]
        except (OSError, ValueError, KeyError, TypeError):
            known = []
        hosts_sweep.register(plan, known + pids)

    @property
    def munge_socket(self) -> Path:
        """munged's socket: in a directory of its own under /tmp (see ``_start``)."""
        if self.munge_dir is None:
            raise SlurmError("the Slurm cluster is not started")
        return self.munge_dir / "munge.socket"

    # -- configuration ------------------------------------------------------------------------------

    def _ctl_addr(self) -> str:
        plan = self.bed.plan
        if plan is None:
            raise SlurmError("the bed is not started")
        return plan.server_addrs[CONTROL]

    def config_text(self, ctl_port: int, slurmd_port: int) -> str:
        """``slurm.conf``: the controller on the control bridge, every bed host a node of ``bed``."""
        r = self.root
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.bed.addr(n, CONTROL)} NodeHostname={n} "
                          f"{self.hardware()} RealMemory=100 State=UNKNOWN" for n in self.bed.names)
        return f"""# written by marind.testing.slurm_bed for one bed; do not edit
ClusterName=marindbed
SlurmctldHost={socket.gethostname()}({self._ctl_addr()})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/spool/%n/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
SlurmctldTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
JobRequeue=1
{nodes}
PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def slurmd_command(self, name: str) -> list[str]:
        """slurmd for host ``name``, in a mount namespace of its own where ``/sys/fs/cgroup`` is a tmpfs.

        slurmd 22.05 initializes its cgroup plugin whatever the other plugins are, and fails on a
        ``/sys/fs/cgroup`` with nothing mounted, which is what a bed host has (``ip netns exec``
        mounts a fresh sysfs). An empty tmpfs there reads as cgroup v1, whose plugin starts without
        touching a hierarchy; with ``proctrack/linuxproc`` and ``task/none`` no cgroup is ever made.
        The mount is private to slurmd and the jobs it starts (``unshare --mount``, private
        propagation): the host's other processes and the machine keep theirs.
        """
        slurmd = [self._bin("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
        script = ("mount -t tmpfs -o size=1m,mode=755 marind-no-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd "
                  "&& mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd "
                  '&& exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "slurmd", *slurmd]

    def hardware(self) -> str:
        """Every node's ``CPUs Boards SocketsPerBoard CoresPerSocket ThreadsPerCore``: this machine's, as
        ``slurmd -C`` sees it (each host is the whole machine; a node configured with more than slurmd
        finds is drained, one laid out otherwise is logged as an error at every start)."""
        res = subprocess.run([self._bin("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
        rec = parse_record(res.stdout.splitlines()[0] if res.returncode == 0 and res.stdout else "")
        keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if not all(k in rec for k in keys):
            return f"CPUs={self.cpus}"
        return " ".join(f"{k}={rec[k]}" for k in keys)

    def env(self, extra: dict | None = None) -> dict[str, str]:
        """What a Slurm client needs: ``SLURM_CONF`` (on top of ``extra``)."""
        return {**{k: str(v) for k, v in (extra or {}).items()}, "SLURM_CONF": str(self.conf)}

    # -- commands -----------------------------------------------------------------------------------

    def command(self, args: list[str], *, host: str | None = None, env: dict | None = None,
                timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client (``scontrol``, ``sinfo``, ...) here, or in ``host``.

        Raises:
            SlurmError: it failed and ``check`` (its stderr in the message).
        """
        cmd = [self._bin(args[0]), *args[1:]]
        if host is not None:
            res = self.bed.run(host, cmd, env=self.env(env), timeout=timeout)
        else:
            res = subprocess.run(cmd, env={**os.environ, **self.env(env)}, capture_output=True, text=True,
                                 timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited with {res.returncode}: {res.stderr.strip()}")
        return res

    def sbatch(self, host: str, args: list[str], *, env: dict | None = None) -> str:
        """``sbatch --parsable ARGS`` run in ``host`` (the job's environment is this one's, ``bed.env``'s
        and ``env``); the job id."""
        res = self.command(["sbatch", "--parsable", *args], host=host, env=env)
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job ID`` as a record ({} once slurmctld has forgotten it)."""
        res = self.command(["scontrol", "show", "job", "--oneliner", job_id], check=False)
        return parse_record(res.stdout) if res.returncode == 0 else {}

    def node(self, name: str) -> dict[str, str]:
        """``scontrol show node NAME`` as a record."""
        return parse_record(self.command(["scontrol", "show", "node", "--oneliner", name]).stdout)

    def wait_job(self, job_id: str, states: set[str] | frozenset[str] = FINAL_JOB_STATES,
                 timeout: float = 600.0, poll: float = 1.0) -> dict[str, str]:
        """Until the job's ``JobState`` is one of ``states``; its record.

        Raises:
            TimeoutError: it was not within ``timeout`` (the message has its last record).
        """
        deadline = time.monotonic() + timeout
        rec = self.job(job_id)
        while rec.get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} not in {sorted(states)} after {timeout:.0f}s: {rec}")
            time.sleep(poll)
            rec = self.job(job_id)
        return rec

    def node_states(self) -> dict[str, str]:
        """``sinfo``'s state of every node (``idle``, ``alloc``, ``down*``, ``drain``, ...)."""
        out = self.command(["sinfo", "--noheader", "--Node", "--format=%N %T"]).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` of a log under the cluster's ``log/`` (``slurmctld.log``, ``slurmd-host1.log``)."""
        try:
            return "\n".join((self.root / "log" / name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {name})"

    # -- helpers ------------------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        path = which(name)
        if path is None:
            raise SlurmError(f"{name} not found: install Slurm (`make setup` as root)")
        return path

    def _log(self, name: str):
        return open(self.root / "log" / name, "ab")

    def _port_open(self, port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex((self._ctl_addr(), port)) == 0

    def _all_idle(self) -> bool:
        try:
            states = self.node_states()
        except (SlurmError, subprocess.TimeoutExpired):
            return False
        return sorted(states) == sorted(self.bed.names) and all(s == "idle" for s in states.values())

    def _wait(self, ready, timeout: float, what: str, proc: subprocess.Popen | None, log_name: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in [proc, *self.slurmds.values()] if p is not None and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"exited with {dead[0].returncode}" if dead else f"not within {timeout:.0f}s"
                tails = "\n".join(f"--- {n} ---\n{self.log_tail(n, 15)}" for n in
                                  [log_name, *(f"slurmd-{h}.log" for h in self.slurmds)])
                raise SlurmError(f"waiting for {what}: {why}\n{tails}")
            time.sleep(0.2)

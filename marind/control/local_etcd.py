"""An etcd member run as a child process: alone, or one member of a cluster started here.

Used by ``marind agent`` for its embedded default (no etcd endpoints
configured), by the test suite and the benches (``marind.testing.etcd_cluster`` starts
three). The server keeps its data in ``data_dir`` so that it can be stopped and started
again with its keys intact, which fault tests rely on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from marind.core.log import get_logger
from marind.core.netutil import free_ports, port_open

log = get_logger(__name__)


# -- server state files ------------------------------------------------------------------------
# A server started here publishes ``{pid, command, cwd, log, endpoint, health_url, health_expect}``
# as JSON so that another process (chaos/etcd_outage.py, chaos/storage_outage.py) can stop it
# and start the same command again; that process then rewrites ``pid``. The owning object
# adopts the new pid (``adopted_server_pid``) so that ``running`` and ``stop()`` stay true.
def write_server_state(path: str | os.PathLike, **state) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def adopted_server_pid(path: str | os.PathLike, command: list[str],
                       own_pid: int | None = None) -> int | None:
    """The live pid the state file names, if it is not ``own_pid`` and runs ``command``."""
    import psutil
    try:
        pid = json.loads(Path(path).read_text()).get("pid")
        proc = psutil.Process(pid)
        if pid == own_pid or proc.status() == psutil.STATUS_ZOMBIE or proc.cmdline() != command:
            return None
        return pid
    except (OSError, ValueError, TypeError, AttributeError, psutil.Error):
        return None


def stop_server_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM a server that is not our child (its process group if it leads one), then SIGKILL."""
    import psutil
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return

    def send(sig):
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not gone():
        send(signal.SIGKILL)


class EtcdNotInstalled(RuntimeError):
    pass


class ServerProcess:
    """A server started here as its own process group, which another process may have
    stopped and restarted meanwhile (the outage injectors, from its state file).

    Subclasses set ``proc`` and ``state_path`` and give ``command()``.
    """

    proc: subprocess.Popen | None
    state_path: Path

    def command(self) -> list[str]:
        """The server's command line (what its state file records)."""
        raise NotImplementedError

    def _adopted(self) -> int | None:
        """The pid of this server restarted by another process (see ``write_server_state``)."""
        if not self.state_path.exists():   # never started: command() may not be ready to build
            return None
        own = self.proc.pid if self.proc else None
        return adopted_server_pid(self.state_path, self.command(), own)

    @property
    def running(self) -> bool:
        """Whether this server (or its restart by another process) is running."""
        return (self.proc is not None and self.proc.poll() is None) or self._adopted() is not None

    @property
    def pid(self) -> int | None:
        """The server's pid (a restart's by another process included), or None if never started."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        return self._adopted() or (self.proc.pid if self.proc else None)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group (SIGKILL after ``timeout``), or the pid of a
        restart by another process; its data stays."""
        adopted = self._adopted()
        proc, self.proc = self.proc, None
        if adopted is not None:
            stop_server_pid(adopted, timeout)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def __exit__(self, *exc):
        self.stop()


class LocalEtcd(ServerProcess):
    """Start/stop/restart one etcd member on 127.0.0.1.

    Ports are chosen once (free at construction) and reused across
    restarts so that clients keep the same endpoint.
    """

    def __init__(self, data_dir: str | os.PathLike, client_port: int | None = None,
                 peer_port: int | None = None, name: str = "marind-etcd",
                 host: str = "127.0.0.1", binary: str | None = None,
                 log_path: str | os.PathLike | None = None, initial_cluster: str | None = None,
                 cluster_token: str | None = None, quota_bytes: int | None = None):
        """One member; ``initial_cluster`` (``name=http://host:peer_port,...``) makes it a member
        of that cluster (every member is given the same string and ``cluster_token``);
        ``quota_bytes``: its database's space quota (``--quota-backend-bytes``; etcd's 2 GiB)."""
        self.quota_bytes = quota_bytes
        self.data_dir = Path(data_dir)
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        self.host = host
        self.name = name
        ports = free_ports(2, host)
        self.client_port = client_port or ports[0]
        self.peer_port = peer_port or ports[1]
        self.binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.state_path = self.data_dir.with_name(self.data_dir.name + ".server.json")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            *(["--initial-cluster-token", self.cluster_token] if self.cluster_token else []),
            "--log-level", "warn",
            *(["--quota-backend-bytes", str(self.quota_bytes)] if self.quota_bytes else []),
        ]

    def start(self, timeout: float = 20.0, wait: bool = True) -> LocalEtcd:
        """Start the member (nothing if it runs); with ``wait``, until it reports healthy (a
        member of a cluster is healthy only once a quorum of members runs)."""
        if not os.path.exists(self.binary):
            raise EtcdNotInstalled(
                f"etcd binary not found ({self.binary}); install the Debian package etcd-server "
                "or run `make setup`")
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        env = dict(os.environ)
        env.pop("ETCDCTL_API", None)
        self.proc = subprocess.Popen(self.command(), stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        logf.close()
        write_server_state(self.state_path, kind="etcd", pid=self.proc.pid, command=self.command(),
                           cwd=os.getcwd(), log=str(self.log_path), endpoint=self.endpoint,
                           health_url=f"{self.endpoint}/health", health_expect='"true"')
        if wait:
            self.wait_healthy(timeout)
        log.info("etcd_started", endpoint=self.endpoint, pid=self.proc.pid, data_dir=str(self.data_dir))
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Until ``/health`` says true (stopping the member and raising TimeoutError after ``timeout``)."""
        import urllib.request
        deadline = time.monotonic() + timeout
        url = f"{self.endpoint}/health"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if port_open(self.host, self.client_port):
                try:
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        if b'"true"' in resp.read():
                            return
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd not healthy within {timeout}s at {url}; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        adopted = self._adopted()
        if adopted is not None:
            stop_server_pid(adopted, timeout=0)
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self, timeout: float = 20.0) -> LocalEtcd:
        self.stop()
        return self.start(timeout)

    def __enter__(self):
        return self.start()

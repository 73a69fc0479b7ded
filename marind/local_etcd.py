"""A single-member etcd server run as a child process.

Used by ``marind agent`` for its embedded default (no etcd endpoints
configured) and by the test suite. The server keeps its data in
``data_dir`` so that it can be stopped and started again with its keys
intact, which fault tests rely on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from marind.log import get_logger
from marind.netutil import free_ports, port_open

log = get_logger(__name__)


class EtcdNotInstalled(RuntimeError):
    pass


class LocalEtcd:
    """Start/stop/restart one etcd member on 127.0.0.1.

    Ports are chosen once (free at construction) and reused across
    restarts so that clients keep the same endpoint.
    """

    def __init__(self, data_dir: str | os.PathLike, client_port: int | None = None,
                 peer_port: int | None = None, name: str = "marind-etcd",
                 host: str = "127.0.0.1", binary: str | None = None,
                 log_path: str | os.PathLike | None = None):
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        ports = free_ports(2, host)
        self.client_port = client_port or ports[0]
        self.peer_port = peer_port or ports[1]
        self.binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

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
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]

    def start(self, timeout: float = 20.0) -> "LocalEtcd":
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
        self._wait_healthy(timeout)
        log.info("etcd_started", endpoint=self.endpoint, pid=self.proc.pid, data_dir=str(self.data_dir))
        return self

    def _wait_healthy(self, timeout: float) -> None:
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

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
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

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self, timeout: float = 20.0) -> "LocalEtcd":
        self.stop()
        return self.start(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

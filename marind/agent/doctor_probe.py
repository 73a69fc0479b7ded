"""The agent's part of `marind doctor --cluster`: start a probe for each request that names this node.

A watch on ``{p}/doctor/requests/`` (``ChangeWatch``: the requests are read
when one changes, and every ``RESYNC_S`` in case an event was lost) finds a
new request; if it lists this node, the agent starts ``python -m
marind.doctor_cluster.probe`` (its own session, its log in
``{state_dir}/doctor/{id}.log``) and forgets it when it exits. A probe still
running ``KILL_MARGIN_S`` past its request's ``timeout_s`` is killed, and so
is every probe when the agent stops. Nothing here blocks the agent's tick:
one etcd read when due, ``poll()`` on the probes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from marind.control.change_watch import ChangeWatch
from marind.control.config import AgentConfig
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.doctor_cluster.keys import Request, requests_prefix

RESYNC_S = 60.0
KILL_MARGIN_S = 10.0


def probe_command(config: AgentConfig, endpoint: str, request_id: str) -> list[str]:
    """The probe's command line for ``request_id`` on this agent's etcd."""
    tls = config.tls
    return [sys.executable, "-m", "marind.doctor_cluster.probe", "--etcd", endpoint, "--prefix", config.prefix,
            "--request", request_id, "--node", config.node,
            *(["--ca-cert", tls.ca_cert] if tls.ca_cert else []), *(["--cert", tls.cert] if tls.cert else []),
            *(["--key", tls.key] if tls.key else [])]


class DoctorProbes:
    """The cluster-check probes of one agent.

    Args:
        client: the agent's etcd client.
        config: the agent's settings (node, prefix, credentials, state dir).
        endpoint: etcd's endpoints, as the agent reaches them.
    """

    def __init__(self, client: EtcdClient, config: AgentConfig, endpoint: str):
        self.client, self.config, self.endpoint = client, config, endpoint
        self.watch = ChangeWatch(client, resync_s=RESYNC_S, prefix=requests_prefix(client))
        self.seen: set[str] = set()
        self.probes: dict[str, tuple[subprocess.Popen, float]] = {}    # id -> (process, kill at)
        self.log = get_logger(__name__, node=config.node)

    def tick(self) -> None:
        """Reap finished probes, kill overdue ones, start one for each new request naming this node."""
        now = time.monotonic()
        for rid, (proc, kill_at) in list(self.probes.items()):
            if proc.poll() is None and now >= kill_at:
                self.log.warning("doctor_probe_overdue", request=rid, pid=proc.pid, action="kill")
                self._kill(proc)
            if proc.poll() is not None:
                del self.probes[rid]
        if not self.watch.due():
            return
        try:
            self.watch.begin_read()
            docs = self.client.get_prefix_json(requests_prefix(self.client))
        except ControlPlaneUnavailable:
            self.watch.poke()
            return
        live = {k.rsplit("/", 1)[-1]: v for k, v in docs.items()}
        self.seen &= set(live)
        for rid, doc in sorted(live.items()):
            if rid in self.seen:
                continue
            self.seen.add(rid)
            try:
                request = Request.from_dict(doc)
            except ValueError as exc:
                self.log.warning("doctor_request_invalid", request=rid, error=str(exc))
                continue
            if self.config.node in request.hosts:
                self._start(request, now)

    def _start(self, request: Request, now: float) -> None:
        logs = Path(self.config.state_dir) / "doctor"
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.config.etcd_user:
            env["MARIND_ETCD_USER"] = self.config.etcd_user
        if self.config.etcd_password:
            env["MARIND_ETCD_PASSWORD"] = self.config.etcd_password
        try:
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / f"{request.id}.log", "ab") as out:
                proc = subprocess.Popen(probe_command(self.config, self.endpoint, request.id), env=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        except OSError as exc:     # a full state dir among others: this host fails the check, the agent goes on
            self.log.warning("doctor_probe_failed", request=request.id, error=str(exc))
            return
        self.probes[request.id] = (proc, now + request.timeout_s + KILL_MARGIN_S)
        self.log.info("doctor_probe_started", request=request.id, pid=proc.pid, hosts=list(request.hosts))

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """Kill the running probes and cancel the watch."""
        for proc, _ in self.probes.values():
            if proc.poll() is None:
                self._kill(proc)
        self.probes.clear()
        self.watch.stop()

"""Stopping a server (etcd, S3) and starting the very same one again, for the outage injectors.

A server is described by a state file that ``marind.control.local_etcd.LocalEtcd``
and ``marind.testing.s3_server.SeaweedS3`` write when they start:
``{kind, pid, command, cwd, log, endpoint, health_url, health_expect}``.
Without one, the server is found as the process listening on the
endpoint's port and described from the OS (command line, cwd). Either
way the pid is checked to still run the recorded command before it is
stopped; the restart runs that command in the same cwd with the same
environment and ports (hence the same data dir), appends to the same
log, and, with a state file, records the new pid there so that the
server's owner keeps control of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from marind.control.local_etcd import stop_server_pid, write_server_state
from marind.core.netutil import port_open


class ServerNotFound(LookupError):
    """No live server matches the state file or the endpoint."""


@dataclass(frozen=True)
class ServerState:
    """A server as its state file (or the OS) describes it: enough to stop it and start the same one again."""

    pid: int
    command: tuple[str, ...]
    cwd: str
    endpoint: str
    kind: str = "server"
    log: str | None = None
    health_url: str | None = None
    health_expect: str | None = None
    path: str | None = None          # the state file, when there is one

    @property
    def host_port(self) -> tuple[str, int]:
        """(host, port) of the endpoint (port 80 when it names none)."""
        parts = urlsplit(self.endpoint if "://" in self.endpoint else "http://" + self.endpoint)
        return parts.hostname or "127.0.0.1", parts.port or 80

    def to_json(self) -> dict:
        """The state file's content."""
        return {"kind": self.kind, "pid": self.pid, "command": list(self.command), "cwd": self.cwd,
                "log": self.log, "endpoint": self.endpoint, "health_url": self.health_url,
                "health_expect": self.health_expect}


def load_state(path: str | os.PathLike) -> ServerState:
    """The state file at ``path``; ServerNotFound when there is none, ValueError when it is unreadable."""
    try:
        raw = json.loads(Path(path).read_text())
        return ServerState(pid=int(raw["pid"]), command=tuple(raw["command"]), cwd=raw["cwd"],
                           endpoint=raw["endpoint"], kind=raw.get("kind", "server"),
                           log=raw.get("log"), health_url=raw.get("health_url"),
                           health_expect=raw.get("health_expect"), path=str(path))
    except FileNotFoundError:
        raise ServerNotFound(f"no server state file at {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad server state file {path}: {exc}") from exc


def listens_on(proc: psutil.Process, port: int) -> bool:
    """Whether ``proc`` has a listening inet socket on ``port``."""
    getter = getattr(proc, "net_connections", None) or proc.connections
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in getter(kind="inet"))
    except psutil.Error:
        return False


def _state_file_beside(command: list[str], pid: int) -> str | None:
    """The state file a LocalEtcd / SeaweedS3 wrote next to the data dir on ``command``, if it names ``pid``."""
    dirs = []
    for i, arg in enumerate(command):
        if arg in ("--data-dir", "-dir") and i + 1 < len(command):
            dirs.append(command[i + 1])
        elif arg.startswith(("--data-dir=", "-dir=")):
            dirs.append(arg.split("=", 1)[1])
    for d in map(Path, dirs):
        for candidate in (d.with_name(d.name + ".server.json"), d.parent / "server.json"):
            try:
                if json.loads(candidate.read_text()).get("pid") == pid:
                    return str(candidate)
            except (OSError, ValueError, AttributeError):
                continue
    return None


def discover(endpoint: str, *, kind: str, health_url: str | None = None,
             health_expect: str | None = None) -> ServerState:
    """Describe the process listening on ``endpoint``'s port from the OS.

    If its owner left a state file beside its data dir, that file is used
    (and updated on restart) so that the owner keeps control of the server.
    """
    probe = ServerState(pid=0, command=(), cwd="/", endpoint=endpoint)
    _, port = probe.host_port
    for proc in psutil.process_iter():
        if proc.pid == os.getpid() or not listens_on(proc, port):
            continue
        try:
            path = _state_file_beside(proc.cmdline(), proc.pid)
            if path:
                state = load_state(path)
                return replace(state, health_url=state.health_url or health_url,
                               health_expect=state.health_expect or health_expect)
            return ServerState(pid=proc.pid, command=tuple(proc.cmdline()), cwd=proc.cwd(),
                               endpoint=endpoint, kind=kind, health_url=health_url,
                               health_expect=health_expect)
        except psutil.Error:
            continue
    raise ServerNotFound(f"no process of this host listens on {endpoint}")


def live_pid(state: ServerState) -> psutil.Process:
    """The server's process, checked to run the recorded command."""
    try:
        proc = psutil.Process(state.pid)
        if proc.status() != psutil.STATUS_ZOMBIE and tuple(proc.cmdline()) == state.command:
            return proc
    except psutil.Error:
        pass
    raise ServerNotFound(f"{state.kind} server pid {state.pid} is not running {state.command[:1]}")


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except psutil.Error:
        return dict(os.environ)


def stop(state: ServerState, timeout: float = 15.0) -> dict:
    """Stop the server; returns the environment it ran with (for ``start``)."""
    env = _environ(live_pid(state))
    stop_server_pid(state.pid, timeout)
    host, port = state.host_port
    deadline = time.monotonic() + timeout
    while port_open(host, port) and time.monotonic() < deadline:
        time.sleep(0.05)
    return env


def start(state: ServerState, env: dict, timeout: float = 60.0) -> ServerState:
    """Run the recorded command again, wait until it answers, record its pid; the new state."""
    log_path = state.log or os.devnull
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(list(state.command), cwd=state.cwd, env=env, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    new = replace(state, pid=proc.pid)
    if state.path:
        write_server_state(state.path, **new.to_json())
    wait_ready(new, proc, timeout)
    return new


def _healthy(state: ServerState) -> bool:
    host, port = state.host_port
    if not port_open(host, port):
        return False
    if not state.health_url:
        return True
    try:
        with urllib.request.urlopen(state.health_url, timeout=2) as resp:
            body = resp.read().decode(errors="replace")
            return state.health_expect is None or state.health_expect in body
    except urllib.error.HTTPError as exc:
        # an S3 server that refuses an unsigned request is up; a 5xx one is still starting
        return state.health_expect is None and exc.code < 500
    except OSError:
        return False


def wait_ready(state: ServerState, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the restarted server answers; RuntimeError if it exits, TimeoutError past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{state.kind} server exited with {proc.returncode} on restart; "
                               f"see {state.log}")
        if _healthy(state):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{state.kind} server at {state.endpoint} not ready {timeout:g}s after "
                       f"restart; see {state.log}")

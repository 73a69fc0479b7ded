"""The outage itself, shared by etcd_outage.py and storage_outage.py: stop, wait, start again."""

from __future__ import annotations

import argparse
import os
import time

from marind.core.log import get_logger
from marind.testing.chaos.common import NothingToDo, emit
from marind.testing.chaos.servers import ServerNotFound, ServerState, discover, live_pid, load_state, start, stop

log = get_logger("chaos.outage")


def add_outage_args(parser: argparse.ArgumentParser, *, env_var: str) -> None:
    """``--state``, ``--seconds``, ``--ready-timeout``: which server, how long it stays down."""
    parser.add_argument("--state", default=os.environ.get(env_var),
                        help=f"the server's state file (default ${env_var}; else the process "
                             "listening on the endpoint is used)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="how long the server stays down (default 10)")
    parser.add_argument("--ready-timeout", type=float, default=90.0,
                        help="seconds to wait for the restarted server to answer (default 90)")


def find_server(state_path: str | None, endpoint: str | None, *, kind: str,
                health_url: str | None = None, health_expect: str | None = None) -> ServerState:
    """The server to cycle, from its state file or the process listening on ``endpoint``; NothingToDo if none runs."""
    try:
        if state_path:
            state = load_state(state_path)
        elif endpoint:
            state = discover(endpoint, kind=kind, health_url=health_url, health_expect=health_expect)
        else:
            raise ValueError(f"name the {kind} server: pass --state FILE or its endpoint")
        live_pid(state)
        return state
    except ServerNotFound as exc:
        raise NothingToDo(str(exc)) from None


def outage(state: ServerState, seconds: float, *, ready_timeout: float, job: str | None,
           seed: int | None, **extra) -> ServerState:
    """Stop ``state``'s server, keep it down ``seconds``, start it again; one line per step."""
    env = stop(state)
    down_at = time.monotonic()
    emit("stop_server", target=state.endpoint, pid=state.pid, kind=state.kind, job=job,
         seconds=seconds, seed=seed, **extra)
    time.sleep(max(0.0, seconds - (time.monotonic() - down_at)))
    new = start(state, env, timeout=ready_timeout)
    emit("start_server", target=new.endpoint, pid=new.pid, kind=new.kind, job=job,
         down_s=round(time.monotonic() - down_at, 3), seed=seed)
    log.info("server_restored", kind=new.kind, endpoint=new.endpoint, old_pid=state.pid,
             new_pid=new.pid)
    return new


def require_job(client, job: str) -> None:
    """Refuse to act for a job the control plane does not know (wrong prefix or endpoint)."""
    if not client.get_prefix(client.key("jobs", job) + "/"):
        raise NothingToDo(f"job {job} has no records under {client.key('jobs', job)}/")

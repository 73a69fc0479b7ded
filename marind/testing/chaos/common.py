"""What every injector shares: its arguments, the etcd connection, its output, its exit code.

Output contract (docs/design.md §6): one JSON line per action on stdout,
``{"action", "target", "pid", "rank", "node", "at", ...}`` (``at`` is Unix
time in seconds; extra keys such as ``seed`` or ``signal`` may follow).
Logs go to stderr. Exit codes: 0 acted, 1 nothing to act on, 2 bad usage,
3 control plane unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from marind.core.errors import ControlPlaneUnavailable, MarindError
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.testing.chaos.targets import job_node_records

EXIT_ACTED = 0
EXIT_NOTHING = 1
EXIT_USAGE = 2
EXIT_CONTROL_PLANE = 3


class NothingToDo(Exception):
    """No target matched: the injector exits 1 with this message."""


def base_parser(description: str, *, job_required: bool = True) -> argparse.ArgumentParser:
    """The flags every injector takes: ``--job``, ``--etcd``, ``--prefix``, ``--seed``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--job", required=job_required, help="job id whose processes are targets")
    parser.add_argument("--etcd", help="etcd endpoint(s); default $MARIND_ETCD, then the "
                                       "endpoint the local agent's embedded etcd publishes")
    parser.add_argument("--prefix", help="etcd key prefix (default $MARIND_PREFIX, the config "
                                         "file's, or /marind)")
    parser.add_argument("--seed", type=int, help="seed of every random choice (default: drawn, "
                                                 "and printed in each action line)")
    return parser


def seeded_rng(args: argparse.Namespace) -> random.Random:
    """The injector's one RNG; fixes ``args.seed`` when it was not given so it can be printed."""
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "big")
    return random.Random(args.seed)


def parse_signal(text: str) -> signal.Signals:
    """``KILL``, ``SIGKILL``, ``kill`` or ``9`` -> ``signal.SIGKILL``."""
    text = str(text).strip()
    try:
        return signal.Signals(int(text))
    except ValueError:
        pass
    name = text.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {text!r}: use a name like KILL or TERM, or a number") from None


def resolve_etcd(flag: str | None) -> str:
    """The agent's documented order: ``--etcd``, ``MARIND_ETCD``, the config file, then the
    endpoint file the agent's embedded etcd writes under its state dir."""
    from marind.control.config import resolve_endpoint
    return resolve_endpoint(flag)[0]


def connect(args: argparse.Namespace) -> EtcdClient:
    """A client the way marind's CLI makes one (prefix, user, TLS from env/config) unless flagged."""
    from marind.control.config import client_settings
    settings = client_settings()
    args.prefix = args.prefix or settings["prefix"]
    return EtcdClient(resolve_etcd(args.etcd), prefix=args.prefix, user=settings["user"],
                      password=settings["password"], tls=settings["tls"])


def emit(action: str, *, target: str, pid: int | None = None, rank: int | None = None,
         node: str | None = None, **extra) -> dict:
    """Print one action line on stdout (flushed at once: a watcher may be reading live)."""
    line = {"action": action, "target": target, "pid": pid, "rank": rank, "node": node,
            "at": round(time.time(), 3), **extra}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    return line


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run an injector's ``main``; map errors to the documented exit codes, one line on stderr."""
    name = Path(sys.argv[0]).stem
    log = get_logger(f"chaos.{name}")
    try:
        return main(argv)
    except NothingToDo as exc:
        log.info("nothing_to_do", reason=str(exc))
        sys.stderr.write(f"{name}: nothing to act on: {exc}\n")
        return EXIT_NOTHING
    except ControlPlaneUnavailable as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return EXIT_CONTROL_PLANE
    except (ValueError, MarindError) as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return getattr(exc, "exit_code", EXIT_USAGE) if isinstance(exc, MarindError) else EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def job_progress_step(client: EtcdClient, job: str, node_records: dict | None = None) -> int | None:
    """The job's current step: its progress record, else the highest step any node reports."""
    progress = client.get_json(client.key("jobs", job, "progress")) or {}
    reported = [progress.get("step")]
    reported += [rec.get("step") for rec in (node_records or {}).values()]
    steps = [s for s in reported if isinstance(s, int)]
    return max(steps) if steps else None


def wait_for_step(client: EtcdClient, job: str, step: int | None, timeout: float) -> None:
    """Block until the job reports ``step`` (no-op when ``step`` is None); NothingToDo on timeout."""
    if step is None:
        return
    ok = wait_until(lambda: (job_progress_step(client, job, job_node_records(client, job)) or -1) >= step,
                    timeout, interval=0.2)
    if not ok:
        raise NothingToDo(f"job {job} did not reach step {step} within {timeout:g}s")


def add_wait_args(parser: argparse.ArgumentParser) -> None:
    """``--after-step`` and ``--wait``: when to act, and how long to look for a target."""
    parser.add_argument("--after-step", type=int, help="act only once the job reports this step")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to keep looking for a target (and for --after-step) "
                             "before giving up with exit 1 (default 0: look once)")

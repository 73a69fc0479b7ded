"""Rendezvous benchmark: marind's etcd3 backend vs torch's c10d backend (TCPStore).

For each agent count N, N simulated agents (processes from a fork server,
each with its own client connection, as N nodes would have) call
``next_rendezvous()`` of their handler for one round with ``--nnodes=N:N``,
so the round completes as soon as the last one joins; no workers are
spawned. The figure is the wall time from the start signal until every
agent has its rank, median over repeats, for each backend in the same run:
etcd3 (marind's ``Etcd3RendezvousHandler``, per-round keys) against a local
single-member etcd started here, c10d (torch's ``DynamicRendezvousHandler``)
against a TCPStore hosted in this process (as ``--rdzv-backend=c10d`` hosts
it in the first agent). ``--backends`` may add ``etcd3-state``: marind's
earlier handler, torch's on one etcd state key
(``marind.rendezvous.state_handler``). All include torch's random 0-0.3 s
first-round delay.

    python bench/rendezvous_bench.py                 # 8, 32, 64 agents, 3 repeats
    python bench/rendezvous_bench.py --quick         # 2 and 4 agents, once: checks the shape
    python bench/rendezvous_bench.py --agents 16,32 --backends etcd3,etcd3-state,c10d

``measure(agent_counts, repeats)`` returns the same dict (imported by
bench/daemon_bench.py). The last stdout line is one JSON object (docs/design.md §7).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from marind.control.local_etcd import LocalEtcd
from marind.core.netutil import free_port
from marind.rendezvous import create_etcd3_handler, create_state_handler
from marind.rendezvous.state_handler import use_frame_method_names
from marind.testing.procs import exit_on_sigterm

JOIN_TIMEOUT_S = 300


def _params(endpoint: str, run_id: str, n: int, **conf) -> RendezvousParameters:
    return RendezvousParameters("bench", endpoint, run_id, n, n,
                                join_timeout=str(JOIN_TIMEOUT_S), **conf)


def _agent(make_handler, ready, go, done, results) -> None:
    """One simulated node (a forked process): connect, wait for the start, rendezvous, report.

    torch's handlers (c10d's, and marind's earlier ``etcd3-state``) name
    every rendezvous event with ``inspect.stack()``, a large CPU cost each;
    they get a frame lookup instead (``use_frame_method_names``), as
    ``etcd3-state`` always did, so the figures compare the backends, not
    that. Without it the largest agent counts on a small machine never
    finished a round (docs/perf.md, "Rendezvous"). marind's etcd3 handler
    records no torch events.
    """
    use_frame_method_names()
    try:
        handler = make_handler()          # connections are made after the fork
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    ready.put(os.getpid())
    go.wait()
    try:
        handler.next_rendezvous()
        results.put(("ok", time.time()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))
    done.wait(JOIN_TIMEOUT_S)
    handler._stop_heartbeats()            # the round's keys are left to expire with the run


def _round(make_handler, n: int) -> float:
    """Seconds from the start signal until all ``n`` simulated nodes have their rank.

    Each node is its own process, as on a real fleet each agent has its own
    interpreter and connection (threads in one process would measure the
    GIL and the gRPC library's process-wide locks instead). They are forked
    by a single-threaded fork server that has torch imported already
    (forking this process, which runs a TCPStore server thread, could copy
    a held lock into a child and hang it).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed.elastic.rendezvous.dynamic_rendezvous",
                                "marind.rendezvous", "bench.rendezvous_bench"])
    ready, results = ctx.Queue(), ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_agent, args=(make_handler, ready, go, done, results), daemon=True)
             for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        for _ in range(n):
            ready.get(timeout=120)
        began = time.time()
        go.set()
        outcomes = [results.get(timeout=JOIN_TIMEOUT_S + 30) for _ in range(n)]
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [what for kind, what in outcomes if kind == "error"]
    if errors:
        raise RuntimeError(f"rendezvous of {n} agents failed: {errors[:3]}")
    return max(when for _, when in outcomes) - began


def _etcd3_round(endpoint: str, prefix: str, n: int, make=create_etcd3_handler) -> float:
    params = _params(endpoint, f"bench-{uuid.uuid4().hex[:8]}", n, prefix=prefix)
    return _round(functools.partial(make, params), n)


def _c10d_handler(port: int, run_id: str, n: int):
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    return create_handler(client, C10dRendezvousBackend(client, run_id),
                          _params(f"127.0.0.1:{port}", run_id, n))


def _c10d_round(port: int, n: int) -> float:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    return _round(functools.partial(_c10d_handler, port, run_id, n), n)


def _summary(runs: list[float]) -> dict:
    return {"median_s": round(statistics.median(runs), 4), "runs_s": [round(r, 4) for r in runs]}


def measure(agent_counts=(8, 32, 64), repeats: int = 3, etcd_endpoint: str | None = None,
            backends=("etcd3", "c10d")) -> dict:
    """Median time of one rendezvous round per agent count, etcd3 vs c10d, as a dict.

    ``agent_counts`` may be one int. The dict: ``{"bench", "agents", "repeats",
    "etcd3": {"N": {"median_s", "runs_s"}}, "c10d": {...}, "ratios": {"etcd3_over_c10d_N"}}``,
    with ``"etcd3-state"`` and ``"etcd3-state_over_c10d_N"`` when that backend was asked for.
    """
    if isinstance(agent_counts, int):
        agent_counts = [agent_counts]
    unknown = set(backends) - {"etcd3", "etcd3-state", "c10d"}
    if unknown:
        raise ValueError(f"unknown rendezvous backend(s) {sorted(unknown)}: use etcd3, etcd3-state, c10d")
    tmp = tempfile.TemporaryDirectory(prefix="marind-rdzv-bench-")
    server = None
    if etcd_endpoint is None:
        server = LocalEtcd(Path(tmp.name) / "etcd").start()
        etcd_endpoint = f"127.0.0.1:{server.client_port}"
    port = free_port()
    tcp_server = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                               timeout=timedelta(seconds=60))
    prefix = f"/marind-bench-{uuid.uuid4().hex[:6]}"
    result: dict = {"bench": "rendezvous", "agents": list(agent_counts), "repeats": repeats,
                    "etcd3": {}, "c10d": {}, "ratios": {}}
    rounds = {"etcd3": lambda n: _etcd3_round(etcd_endpoint, prefix, n),
              "etcd3-state": lambda n: _etcd3_round(etcd_endpoint, prefix, n, create_state_handler),
              "c10d": lambda n: _c10d_round(port, n)}
    try:
        for n in agent_counts:
            runs = {name: [rounds[name](n) for _ in range(repeats)] for name in rounds if name in backends}
            for name, times in runs.items():
                result.setdefault(name, {})[str(n)] = _summary(times)
            for name in ("etcd3", "etcd3-state"):
                if name in runs and "c10d" in runs:
                    result["ratios"][f"{name}_over_c10d_{n}"] = round(
                        statistics.median(runs[name]) / statistics.median(runs["c10d"]), 3)
    finally:
        del tcp_server
        if server is not None:
            server.stop()
        tmp.cleanup()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 agents, one repeat")
    parser.add_argument("--agents", default="8,32,64", help="comma-separated agent counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--etcd", default=None, help="use this etcd (HOST:PORT) instead of a local one")
    parser.add_argument("--backends", default="etcd3,c10d",
                        help="comma-separated: etcd3, c10d, etcd3-state (marind's earlier single-key handler)")
    args = parser.parse_args(argv)
    counts = [2, 4] if args.quick else [int(x) for x in args.agents.split(",")]
    repeats = 1 if args.quick else args.repeats
    result = measure(counts, repeats, etcd_endpoint=args.etcd, backends=tuple(args.backends.split(",")))
    result["mode"] = "quick" if args.quick else "full"
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

"""Rendezvous benchmark: marind's etcd3 backend vs torch's c10d backend (TCPStore).

For each agent count N, N simulated agents (threads, one client
connection each, as N nodes would have) call
``DynamicRendezvousHandler.next_rendezvous()`` for one round with
``--nnodes=N:N``, so the round completes as soon as the last one joins;
no workers are spawned. The figure is the wall time from the start signal
until every agent has its rank, median over repeats, for both backends in
the same run: etcd3 against a local single-member etcd started here,
c10d against a TCPStore hosted in this process (as ``--rdzv-backend=c10d``
hosts it in the first agent). Both include torch's built-in random
0-0.3 s first-round delay.

    python bench/rendezvous_bench.py                 # 8, 32, 64 agents, 3 repeats
    python bench/rendezvous_bench.py --quick         # 2 and 4 agents, once: checks the shape

``measure(agent_counts, repeats)`` returns the same dict (imported by
bench/daemon_bench.py). The last stdout line is one JSON object (DESIGN §7).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: E402
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler  # noqa: E402

from marind.local_etcd import LocalEtcd  # noqa: E402
from marind.netutil import free_port  # noqa: E402
from marind.rendezvous import create_etcd3_handler  # noqa: E402

JOIN_TIMEOUT_S = 300


def _params(endpoint: str, run_id: str, n: int, **conf) -> RendezvousParameters:
    return RendezvousParameters("bench", endpoint, run_id, n, n,
                                join_timeout=str(JOIN_TIMEOUT_S), **conf)


def _round(handlers) -> float:
    """Seconds until every handler has completed one rendezvous round."""
    start = threading.Barrier(len(handlers) + 1)
    errors: list = []

    def join(handler):
        start.wait()
        try:
            handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join(JOIN_TIMEOUT_S + 30)
    elapsed = time.perf_counter() - began
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"rendezvous of {len(handlers)} agents failed: {errors[:3]}")
    return elapsed


def _quiet(handlers) -> None:
    for handler in handlers:  # stop keep-alives; the round's keys are left to expire with the run
        handler._stop_heartbeats()


def _etcd3_round(endpoint: str, prefix: str, n: int) -> float:
    params = _params(endpoint, f"bench-{uuid.uuid4().hex[:8]}", n, prefix=prefix)
    handlers = [create_etcd3_handler(params) for _ in range(n)]
    try:
        return _round(handlers)
    finally:
        _quiet(handlers)


def _c10d_round(port: int, n: int) -> float:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handlers = []
    for _ in range(n):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        handlers.append(create_handler(client, C10dRendezvousBackend(client, run_id),
                                       _params(f"127.0.0.1:{port}", run_id, n)))
    try:
        return _round(handlers)
    finally:
        _quiet(handlers)


def _summary(runs: list[float]) -> dict:
    return {"median_s": round(statistics.median(runs), 4), "runs_s": [round(r, 4) for r in runs]}


def measure(agent_counts=(8, 32, 64), repeats: int = 3, etcd_endpoint: str | None = None,
            backends=("etcd3", "c10d")) -> dict:
    """Median time of one rendezvous round per agent count, etcd3 vs c10d, as a dict.

    ``agent_counts`` may be one int. The dict: ``{"bench", "agents", "repeats",
    "etcd3": {"N": {"median_s", "runs_s"}}, "c10d": {...}, "ratios": {"etcd3_over_c10d_N"}}``.
    """
    if isinstance(agent_counts, int):
        agent_counts = [agent_counts]
    unknown = set(backends) - {"etcd3", "c10d"}
    if unknown:
        raise ValueError(f"unknown rendezvous backend(s) {sorted(unknown)}: use etcd3 and/or c10d")
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
    try:
        for n in agent_counts:
            runs = {}
            if "etcd3" in backends:
                runs["etcd3"] = [_etcd3_round(etcd_endpoint, prefix, n) for _ in range(repeats)]
            if "c10d" in backends:
                runs["c10d"] = [_c10d_round(port, n) for _ in range(repeats)]
            for name, times in runs.items():
                result[name][str(n)] = _summary(times)
            if len(runs) == 2:
                result["ratios"][f"etcd3_over_c10d_{n}"] = round(
                    statistics.median(runs["etcd3"]) / statistics.median(runs["c10d"]), 3)
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
    args = parser.parse_args(argv)
    counts = [2, 4] if args.quick else [int(x) for x in args.agents.split(",")]
    repeats = 1 if args.quick else args.repeats
    result = measure(counts, repeats, etcd_endpoint=args.etcd)
    result["mode"] = "quick" if args.quick else "full"
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

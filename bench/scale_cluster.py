"""One size of ``bench/scale.py``: N simulated nodes against a fresh etcd, every figure of that N.

``measure(n, ...)`` starts a private etcd (``LocalEtcd``), forks ``workers`` processes
(``bench/scale_worker.py``; one of them hosts the TCPStore of torch's c10d backend and submits
the job, so that this process holds no thread or connection when it forks the next size's),
spreads the N nodes over them, and measures, in this order:

1. ``etcd3_round_s`` and ``c10d_rendezvous_s``: one round of N bare handlers (marind's etcd3,
   torch's c10d) from a start signal until every one has its rank, the same harness for both
   (threads in the worker processes);
2. ``rendezvous_s``: the simulated nodes register, a job of ``min:N`` nodes is submitted
   (``JobsClient.submit``), and the time from the submit until every node holds its rank;
3. steady state: etcd's own counters over ``steady_intervals`` report intervals with the job
   running: requests and bytes (in + out) per node per second, the database's size;
   ``mem_per_node_mb``: the workers' RSS growth from making the nodes, per node;
4. ``silent_loss_round_s``: one node falls silent (``SimNode.silence``: keep-alives, reports
   and workers stop at once; the others' workers stall on it) until every survivor holds a
   rank in a round without it; then ``loss_1pct_round_s``: the same with 1 % of the nodes
   (at least one) at once.

A figure that could not be measured (a round that did not complete in time) is None, with
the reason under ``notes``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import tempfile
import time
import uuid
from pathlib import Path

from marind.control.local_etcd import LocalEtcd
from marind.core.spec import load_spec
from marind.testing.etcd_metrics import etcd_counters

SPEC = """
[job]
name = "scale"
nodes = "{lo}:{hi}"
nproc_per_node = 8
entrypoint = "marind.trainer"
[data]
path = "unused"
global_batch = 64
micro_batch = 1
[train]
steps = 1000000
[checkpoint]
url = "file:///tmp/marind-scale-unused"
"""


class _Workers:
    """The worker processes and their pipes (``scale_worker.serve``)."""

    def __init__(self, count: int):
        # forked: no second import of torch per worker (seconds each on a busy machine); this process
        # has no threads nor etcd channels yet (``measure`` makes them after the workers)
        ctx = mp.get_context("fork")
        self.go = ctx.Event()
        self.pipes, self.procs = [], []
        from bench.scale_worker import serve
        for _ in range(count):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(there, self.go), daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    def ask(self, cmd: str, args: list, timeout: float = 300) -> list:
        """Send ``(cmd, args[i])`` to worker i (all at once), then collect every answer."""
        for pipe, arg in zip(self.pipes, args, strict=True):
            pipe.send((cmd, arg))
        return [self._recv(pipe, timeout) for pipe in self.pipes]

    def _recv(self, pipe, timeout: float):
        if not pipe.poll(timeout):
            raise TimeoutError(f"a scale worker did not answer within {timeout:.0f}s")
        return pipe.recv()

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            try:
                if pipe.poll(30):
                    pipe.recv()
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def handlers_round(w: _Workers, kind: str, endpoint: str, n: int, prefix: str, timeout: float) -> tuple[float | None, str]:
    """One round of ``n`` bare handlers of ``kind`` spread over the workers: seconds from the
    start signal until every one has its rank (None and why when they did not)."""
    run_id = f"{kind}-{uuid.uuid4().hex[:8]}"
    counts = [len(part) for part in _split(list(range(n)), len(w.pipes))]
    for pipe, count in zip(w.pipes, counts, strict=True):
        pipe.send(("handlers", (kind, endpoint, run_id, n, count, prefix)))
    for pipe in w.pipes:
        w._recv(pipe, 180)
    began = time.time()
    w.go.set()
    try:
        done = [w._recv(pipe, 400) for pipe in w.pipes]     # each worker answers once its handlers end (<= 330 s)
    finally:
        w.go.clear()
    failed = sum(d["failed"] for d in done)
    if failed:
        return None, f"{failed} of {n} {kind} handlers had no rank: {[e for d in done for e in d['errors']][:2]}"
    return max(t for d in done for t in d["finished"]) - began, ""


def _states(w: _Workers) -> dict:
    out: dict = {}
    for answer in w.ask("state", [None] * len(w.pipes)):
        out.update(answer["nodes"])
    return out


def wait_first(w: _Workers, names: list[str], since: float, timeout: float) -> tuple[float | None, list[str], str]:
    """The job's first round: seconds from ``since`` until every participant holds its rank, and
    the participants. A round may close short of all N (``min`` joined and torch's
    ``last_call_timeout`` passed before the rest had joined: a busy machine's late ticks); its
    nodes are then the ones measured on, and the reason says how many were left out."""
    deadline = time.time() + timeout
    while True:
        states = _states(w)
        got = {n: states[n]["rounds"][0] for n in names if states[n]["rounds"]}
        world = next(iter(got.values()))["world"] if got else None
        if world is not None and len(got) >= world:
            members = sorted(n for n, r in got.items() if r["world"] == world)
            why = "" if world == len(names) else (f"the first round closed with {world} of {len(names)} nodes "
                                                  "(last_call_timeout passed before the rest joined)")
            return max(got[n]["at"] for n in members) - since, members, why
        if time.time() > deadline:
            errors = [e for n in names for e in states[n]["errors"]][:2]
            started = sum(states[n]["started"] for n in names)
            handlers = sum(states[n]["handler"] for n in names)
            return None, [], (f"{len(got)} of {len(names)} nodes held a rank after {timeout:.0f}s (world {world}; "
                              f"{started} saw the job, {handlers} made their handler); errors: {errors}")
        time.sleep(0.25)


def wait_round(w: _Workers, names: list[str], rounds_before: dict[str, int], world: int, since: float,
               timeout: float) -> tuple[float | None, str]:
    """Seconds from ``since`` until every node of ``names`` holds a rank in a round of ``world``
    that it got after its ``rounds_before`` rounds (None and why at the timeout)."""
    deadline = time.time() + timeout
    while True:
        states = _states(w)
        got = [states[n]["rounds"][rounds_before[n]:] for n in names]
        ready = [r for r in got if any(x["world"] == world for x in r)]
        if len(ready) == len(names):
            return max(next(x["at"] for x in r if x["world"] == world) for r in ready) - since, ""
        if time.time() > deadline:
            errors = [e for n in names for e in states[n]["errors"]][:2]
            return None, (f"{len(ready)} of {len(names)} nodes held a rank in a round of {world} after "
                          f"{timeout:.0f}s; errors: {errors}")
        time.sleep(0.25)


def measure(n: int, *, workers: int | None = None, steady_intervals: int = 5, report_interval: float = 2.0,
            lease_ttl: int = 10, c10d: bool = True, loss: bool = True, bare_only: bool = False,
            join_events: bool = True, log=print) -> dict:
    """Every figure of one size (module doc); ``log`` gets a line per stage."""
    workers = workers or max(1, min(64, math.ceil(n / 32)))
    tmp = tempfile.TemporaryDirectory(prefix="marind-scale-")
    etcd = LocalEtcd(Path(tmp.name) / "etcd").start()
    endpoint = etcd.endpoint
    prefix = f"/scale-{uuid.uuid4().hex[:6]}"
    out: dict = {"nodes": n, "workers": workers, "notes": []}
    w = _Workers(workers)
    round_timeout = 60 + n / 4
    try:
        out["etcd3_round_s"], why = handlers_round(w, "etcd3", endpoint, n, prefix, round_timeout)
        log(f"{n} nodes: etcd3 bare round {out['etcd3_round_s']} {why}")
        if why:
            out["notes"].append(why)
        out["c10d_rendezvous_s"] = None
        if c10d:
            w.pipes[0].send(("tcpstore", None))
            tcp_port = w._recv(w.pipes[0], 120)
            out["c10d_rendezvous_s"], why = handlers_round(w, "c10d", f"127.0.0.1:{tcp_port}", n, prefix,
                                                           round_timeout)
            log(f"{n} nodes: c10d bare round {out['c10d_rendezvous_s']} {why}")
            if why:
                out["notes"].append(why)
        if bare_only:
            return out
        names = [f"node{i:05d}" for i in range(n)]     # the same spelling as ``alive`` below
        conf = {"endpoint": endpoint, "prefix": prefix, "lease_ttl": lease_ttl, "report_interval": report_interval,
                "nodes_min": max(1, n - 2 - math.ceil(n / 100)), "nodes_max": n, "join_events": join_events}
        parts = _split(names, workers)
        started = w.ask("start", [(conf, part) for part in parts], timeout=120 + n)
        rss_growth = sum(s["rss_after"] - s["rss_before"] for s in started)
        spec = Path(tmp.name) / "scale.toml"
        spec.write_text(SPEC.format(lo=conf["nodes_min"], hi=n))
        w.pipes[0].send(("submit", (endpoint, prefix, load_spec(spec).to_dict())))
        job, submitted = w._recv(w.pipes[0], 60)
        out["rendezvous_s"], names, why = wait_first(w, names, submitted, round_timeout)
        out["first_round_world"] = len(names)
        log(f"{n} nodes: first round from the submit {out['rendezvous_s']} (world {len(names)}) {why}")
        if why:
            out["notes"].append(why)
        if not names:
            return out
        time.sleep(2 * report_interval)                     # every node has reported at least once
        window = steady_intervals * report_interval
        before, t0 = etcd_counters(endpoint), time.monotonic()
        time.sleep(window)
        after, took = etcd_counters(endpoint), time.monotonic() - t0
        out["etcd_requests_per_node_s"] = round((after["requests"] - before["requests"]) / n / took, 3)
        out["etcd_bytes_per_node_s"] = round(
            (after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"]) / n / took, 1)
        out["etcd_db_mb"] = round(after["db_bytes"] / 2**20, 2)
        out["mem_per_node_mb"] = round((sum(w.ask("rss", [None] * workers)) - sum(s["rss_before"] for s in started))
                                       / n / 2**20, 3)
        out["mem_per_node_at_start_mb"] = round(rss_growth / n / 2**20, 3)
        log(f"{n} nodes: steady {out['etcd_requests_per_node_s']} req/s/node, {out['etcd_bytes_per_node_s']} B/s/node")
        w.pipes[0].send(("events", job))          # events numbered: each node's node_joined at least
        out["events_written"] = int(w._recv(w.pipes[0], 60) or 0)  # (none is dropped: no compare-and-swap)
        out["silent_loss_round_s"] = out["loss_1pct_round_s"] = None
        if loss:
            # victims from the first round's nodes; every node still alive (one the first round left
            # out too: it waits in the next) must hold a rank in the round that forms without them
            pool, alive = list(names), [f"node{i:05d}" for i in range(n)]
            for key, count in (("silent_loss_round_s", 1), ("loss_1pct_round_s", max(1, math.ceil(len(names) / 100)))):
                victims, pool = pool[-count:], pool[:-count]
                alive = [x for x in alive if x not in victims]
                counts = {nm: len(s["rounds"]) for nm, s in _states(w).items()}
                at = min(x for x in w.ask("silence", [[v for v in part if v in victims] for part in parts]))
                w.ask("stall", [None] * workers)
                out[key], why = wait_round(w, alive, counts, len(alive), at, lease_ttl + 60 + n / 8)
                log(f"{n} nodes: {count} lost -> new round {out[key]} {why}")
                if why:
                    out["notes"].append(why)
                    break
        ticks = w.ask("state", [None] * workers)
        out["late_ticks"] = sum(t["late_ticks"] for t in ticks)
        out["agent_ticks"] = sum(t["ticks"] for t in ticks)
        errors = [e for t in ticks for s in t["nodes"].values() if not s["silent"] for e in s["errors"]]
        if errors:
            out["notes"].append(f"{len(errors)} node errors, first: {errors[0]}")
        out["job"] = job
        return out
    finally:
        w.close()
        etcd.stop()
        tmp.cleanup()

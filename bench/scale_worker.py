"""A worker process of ``bench/scale.py``: many simulated nodes, or many bare rendezvous handlers.

The parent talks to each worker over a pipe, one command and one answer at a time
(``serve``):

* ``("start", (conf, names))``: make a ``SimNode`` per name, register each, and start the
  threads that run their agent ticks every ``TICK_S`` (``NODES_PER_TICKER`` nodes a thread)
  and their outbox flushes; answers the process's RSS before and after;
* ``("state", None)``: each node's rounds and errors; ``("get", parts)``: the value of
  ``{p}/parts...``; ``("events", job)``: how many events the job's appends numbered
  (``events_numbered``); ``("silence", names)``, ``("stall",
  None)``: the bench's faults (``SimNode.silence``/``stall``); ``("rss", None)``;
* ``("handlers", (kind, endpoint, run_id, n_total, count))``: ``count`` bare handlers of
  one rendezvous (``etcd3``: marind's, ``c10d``: torch's on a TCPStore at ``endpoint``), each
  on a thread that waits for the shared ``go`` event, then calls ``next_rendezvous`` once
  (answers ``"ready"``, then, once all are done, their finish times and errors): the same
  harness for both backends, as ``bench/rendezvous_bench.py`` drives them;
* ``("tcpstore", None)``: host torch's TCPStore for the c10d rounds (its port); ``("submit",
  (endpoint, prefix, spec))``: submit the job (``JobsClient.submit``; its id and the time);
* ``("stop", None)``: end every node and the process.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import psutil

from bench.scale_node import SimConf, SimNode
from marind.core.log import configure_logging

#: the agent's tick (``marind.agent.daemon.TICK_S``)
TICK_S = 0.5
#: nodes whose ticks (and, on another thread, outbox flushes) one thread runs in turn: each agent
#: has a loop of its own, so a slow etcd must not make one node's tick wait for many others'
NODES_PER_TICKER = 4


def _rss() -> int:
    return psutil.Process().memory_info().rss


class _Ticker(threading.Thread):
    """Runs every node's agent tick (or, ``flush``, its outbox flush) every ``TICK_S`` (a late pass
    starts at once, and is counted)."""

    def __init__(self, nodes: list[SimNode], flush: bool = False):
        super().__init__(name="scale-flusher" if flush else "scale-ticker", daemon=True)
        self.nodes, self.flush, self.late, self.passes = nodes, flush, 0, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            began = time.monotonic()
            for node in list(self.nodes):
                node.flush() if self.flush else node.tick(time.time())
            self.passes += 1
            left = TICK_S - (time.monotonic() - began)
            if left < 0:
                self.late += 1
            self.stopped.wait(max(0.0, left))


def _handler(kind: str, endpoint: str, run_id: str, n: int, prefix: str):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(kind, endpoint, run_id, n, n, join_timeout="300", prefix=prefix)
    if kind == "etcd3":
        from marind.rendezvous.handler import create_handler
        return create_handler(params)
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_handler

    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
    params = RendezvousParameters(kind, endpoint, run_id, n, n, join_timeout="300")
    return torch_handler(store, C10dRendezvousBackend(store, run_id), params)


def _handlers_round(conn, go, kind: str, endpoint: str, run_id: str, n: int, count: int, prefix: str) -> None:
    made, errors, finished = [], [], []

    def one() -> None:
        try:
            handler = _handler(kind, endpoint, run_id, n, prefix)
            made.append(handler)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        go.wait()
        try:
            handler.next_rendezvous()
            finished.append(time.time())
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(made) + len(errors) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.send("ready")
    for t in threads:
        t.join(330)
    for handler in made:
        handler._stop_heartbeats()
    conn.send({"finished": finished, "errors": errors[:3], "failed": len(errors) + count - len(finished) - len(errors)})


def serve(conn, go) -> None:
    """The worker's command loop (module doc)."""
    os.environ["MARIND_LOG_LEVEL"] = "ERROR"
    configure_logging("ERROR")
    from marind.rendezvous.state_handler import use_frame_method_names
    use_frame_method_names()          # torch's handler names its events without inspect.stack (rendezvous_bench)
    nodes: dict[str, SimNode] = {}
    tickers: list[_Ticker] = []
    tcp = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "start":
            conf, names = arg
            before = _rss()
            made = [SimNode(name, SimConf(**conf)) for name in names]
            for node in made:
                node.start()
            nodes.update((n.name, n) for n in made)
            every = list(nodes.values())
            groups = [every[i:i + NODES_PER_TICKER] for i in range(0, len(every), NODES_PER_TICKER)]
            tickers = [_Ticker(g) for g in groups] + [_Ticker(g, flush=True) for g in groups]
            for thread in tickers:
                thread.start()
            conn.send({"rss_before": before, "rss_after": _rss()})
        elif cmd == "state":
            conn.send({"nodes": {n: {"rounds": list(node.rounds), "errors": node.errors[-3:], "silent": node.silent,
                                     "started": node.job is not None, "handler": node.handler is not None}
                                 for n, node in nodes.items()},
                       "late_ticks": sum(t.late for t in tickers if not t.flush),
                       "ticks": sum(t.passes for t in tickers if not t.flush)})
        elif cmd == "silence":
            for name in arg:
                nodes[name].silence()
            conn.send(time.time())
        elif cmd == "stall":
            for node in nodes.values():
                node.stall()
            conn.send(None)
        elif cmd == "rss":
            conn.send(_rss())
        elif cmd == "get":                    # a key's value (its parts under marind's prefix), by a node's client
            client = next(iter(nodes.values())).client
            conn.send(client.get(client.key(*arg))[0])
        elif cmd == "events":                 # how many events the job's appends numbered
            from marind.control.events import events_numbered

            conn.send(events_numbered(next(iter(nodes.values())).client, arg))
        elif cmd == "tcpstore":               # torch's c10d store, hosted here (the parent stays free of threads)
            import torch.distributed as dist

            from marind.core.netutil import free_port
            port = free_port()
            tcp = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                                timeout=timedelta(seconds=300))
            conn.send(port)
        elif cmd == "submit":                 # the job, as `marind submit` writes it
            from marind.control.jobs_client import JobsClient
            from marind.core.etcd_client import EtcdClient
            endpoint, prefix, spec = arg
            with EtcdClient(endpoint, prefix=prefix) as client:
                at = time.time()
                conn.send((JobsClient(client).submit(spec, "scale"), at))
        elif cmd == "handlers":
            _handlers_round(conn, go, *arg)
        elif cmd == "stop":
            for thread in tickers:
                thread.stopped.set()
            for thread in tickers:
                thread.join(10)
            for node in nodes.values():
                node.stop()
            del tcp
            conn.send(None)
            return

"""One host's part of a cluster check: ``python -m marind.doctor_cluster.probe``, started by its agent.

    python -m marind.doctor_cluster.probe --etcd EP --prefix P --request ID --node NODE

1. listens on a TCP port (every address) and publishes ``addr/{node}``: its
   hostname's address, where torch's default puts the workers' store too;
2. waits for every host's listener (``Phases.gather_s``), connects to each
   (``Phases.connect_s``, in parallel) and publishes ``reach/{node}``;
3. waits for every row, decides the group (``verdict.choose_group``) and
   writes ``plan`` if no probe did yet (create only if absent); all follow
   the plan that is there, so every probe ranks the same members;
4. a member joins a process group (the device's backend,
   ``marind.distributed``) whose store is etcd (``Etcd3Store`` under the
   run's keys: no host is special), runs a barrier, 20 one-element
   all-reduces (median: latency) and 3 of ``request.bytes`` (median: bus
   bandwidth);
5. writes ``result/{node}`` and exits. A watchdog writes the phase it was in
   as the error and exits when the request's time is up.

etcd credentials: ``MARIND_ETCD_USER``/``MARIND_ETCD_PASSWORD``; TLS files by flag.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.etcd_endpoints import EtcdTLS
from marind.core.log import get_logger
from marind.doctor_cluster.keys import Phases, Request, request_key, run_key
from marind.doctor_cluster.verdict import OK, Group, HostResult, bus_bandwidth, choose_group, median

LATENCY_ITERS = 20
BANDWIDTH_ITERS = 3
POLL_S = 0.2

log = get_logger("doctor_cluster.probe")


def own_address() -> tuple[str, str]:
    """(hostname, the address it resolves to here; the hostname itself when it does not resolve)."""
    host = socket.gethostname()
    try:
        return host, socket.gethostbyname(socket.getfqdn())
    except OSError:
        return host, host


def connect_outcome(addr: str, port: int, timeout: float) -> str:
    """``"ok"`` when a TCP connect to ``addr:port`` succeeds within ``timeout``, else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return OK
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def _serve(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.close()


def _wait_rows(client: EtcdClient, prefix: str, want: set[str], deadline: float) -> dict[str, dict]:
    """The JSON rows under ``prefix`` by node, once all of ``want`` are there or at ``deadline``."""
    while True:
        rows = {k.rsplit("/", 1)[-1]: v for k, v in client.get_prefix_json(prefix).items()}
        if want <= set(rows) or time.monotonic() >= deadline:
            return rows
        time.sleep(POLL_S)


class Probe:
    """One probe run.

    Args:
        client: etcd, the user's prefix.
        make_client: another client on a given prefix (the process group's store).
        request: the request.
        node: this node's name.
    """

    def __init__(self, client: EtcdClient, make_client: Callable[[str], EtcdClient], request: Request, node: str):
        self.client, self.make_client, self.req, self.node = client, make_client, request, node
        self.phases = Phases.of(request.timeout_s)
        self.phase = "starting"
        self.host, self.addr = own_address()
        self.rank: int | None = None
        self.world = 0
        self.backend = ""

    def key(self, *parts: str) -> str:
        return run_key(self.client, self.req.id, *parts)

    def result(self, error: str | None = None, latency: float | None = None,
               busbw: float | None = None) -> HostResult:
        """This host's result so far."""
        return HostResult(node=self.node, host=self.host, rank=self.rank, world_size=self.world,
                          backend=self.backend, latency_s=latency, bus_bandwidth=busbw, error=error)

    def publish(self, result: HostResult) -> None:
        """Write ``result/{node}``."""
        self.client.put_json(self.key("result", self.node), asdict(result))

    def reachability(self) -> dict[str, dict]:
        """Steps 1-2: listen, publish, connect to every peer. Returns every host's listener record."""
        listener = socket.create_server(("0.0.0.0", 0))
        threading.Thread(target=_serve, args=(listener,), daemon=True).start()
        self.client.put_json(self.key("addr", self.node), {"node": self.node, "host": self.host,
                                                           "addr": self.addr, "port": listener.getsockname()[1]})
        self.phase = "waiting for the other hosts' probes"
        addrs = _wait_rows(self.client, self.key("addr") + "/", set(self.req.hosts),
                           time.monotonic() + self.phases.gather_s)
        self.phase = "connecting to the other hosts"
        row: dict[str, str] = {}
        peers = [h for h in self.req.hosts if h != self.node]

        def one(peer: str) -> None:
            rec = addrs.get(peer)
            row[peer] = ("no listener (its probe never started)" if rec is None
                         else connect_outcome(rec["addr"], int(rec["port"]), self.phases.connect_s))
        threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.phases.connect_s + 5)
        row = {p: row.get(p, "timeout") for p in peers}
        self.client.put_json(self.key("reach", self.node), row)
        log.info("reachability", request=self.req.id, node=self.node, row=row)
        return addrs

    def agree(self, addrs: dict[str, dict]) -> Group:
        """Step 3: every row (or the deadline), then the plan: ours if first, else the one there."""
        self.phase = "waiting for the other hosts' reachability"
        reach = _wait_rows(self.client, self.key("reach") + "/", set(addrs),
                           time.monotonic() + self.phases.gather_s)
        mine = choose_group(self.req.hosts, reach)
        self.client.create(self.key("plan"), json.dumps(mine.to_dict(), sort_keys=True))
        return Group.from_dict(self.client.get_json(self.key("plan")) or mine.to_dict())

    def collective(self, group: Group) -> HostResult:
        """Step 4: the process group, barrier, latency and bandwidth all-reduces.

        On an error the group is not destroyed (that could block on the failed peer): the
        process publishes the error and exits."""
        import torch
        import torch.distributed as dist

        from marind.distributed import backend_for, device_for_local_rank, shutdown_distributed
        from marind.rendezvous.store import Etcd3Store

        self.rank, self.world = group.members.index(self.node), len(group.members)
        device = device_for_local_rank()
        self.backend = backend_for(device)
        timeout = timedelta(seconds=self.phases.collective_s)
        store = Etcd3Store(self.make_client(self.key("pg")), "doctor", timeout=timeout)
        self.phase = f"joining the process group ({self.backend}, rank {self.rank} of {self.world})"
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=timeout, **kwargs)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.phase = "barrier"
        dist.barrier()
        self.phase = "latency all-reduces"
        small = torch.ones(1, device=device)
        dist.all_reduce(small)
        sync()
        if small.item() != self.world:
            return self.result(f"all-reduce returned {small.item()}, expected {self.world}")
        small.zero_()
        times = []
        for _ in range(LATENCY_ITERS):
            tic = time.perf_counter()
            dist.all_reduce(small)
            sync()
            times.append(time.perf_counter() - tic)
        self.phase = f"bandwidth all-reduces ({self.req.bytes} bytes)"
        big = torch.ones(self.req.bytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(big)
        sync()
        bw = []
        for _ in range(BANDWIDTH_ITERS):
            tic = time.perf_counter()
            dist.all_reduce(big)
            sync()
            bw.append(time.perf_counter() - tic)
        self.phase = "leaving the process group"
        shutdown_distributed()      # barrier + destroy: no rank leaves while a peer still sends
        return self.result(latency=median(times), busbw=bus_bandwidth(big.numel() * 4, median(bw) or 0.0, self.world))

    def run(self) -> HostResult:
        """The whole probe; its result (the error says which phase failed)."""
        addrs = self.reachability()
        group = self.agree(addrs)
        if self.node not in group.members:
            return self.result(group.excluded.get(self.node, "left out of the group"))
        try:
            return self.collective(group)
        except Exception as exc:  # noqa: BLE001 - any failure of the collective is the finding
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return self.result(f"{self.phase} failed: {type(exc).__name__}: {first}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marind.doctor_cluster.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--request", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--ca-cert")
    parser.add_argument("--cert")
    parser.add_argument("--key")
    args = parser.parse_args(argv)
    tls = EtcdTLS(ca_cert=args.ca_cert, cert=args.cert, key=args.key)
    user, password = os.environ.get("MARIND_ETCD_USER"), os.environ.get("MARIND_ETCD_PASSWORD")

    def make_client(prefix: str) -> EtcdClient:
        return EtcdClient(args.etcd, prefix=prefix, user=user, password=password, tls=tls)
    client = make_client(args.prefix)
    doc = client.get_json(request_key(client, args.request))
    if doc is None:
        log.warning("request_gone", request=args.request)
        return 0
    probe = Probe(client, make_client, Request.from_dict(doc), args.node)

    def time_up() -> None:
        log.error("probe_timed_out", request=args.request, phase=probe.phase)
        try:
            probe.publish(probe.result(f"timed out while {probe.phase}"))
        finally:
            os._exit(1)
    watchdog = threading.Timer(probe.req.timeout_s, time_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        result = probe.run()
    except ControlPlaneUnavailable as exc:
        log.error("probe_lost_etcd", request=args.request, error=str(exc))
        os._exit(1)
    except Exception as exc:  # noqa: BLE001 - reported as this host's error
        result = probe.result(f"{probe.phase} failed: {type(exc).__name__}: {exc}")
    try:
        probe.publish(result)
    except ControlPlaneUnavailable as exc:
        log.error("probe_lost_etcd", request=args.request, error=str(exc), result=asdict(result))
        os._exit(1)
    log.info("probe_done", request=args.request, node=args.node, result=asdict(result))
    sys.stdout.flush()
    os._exit(0)     # no waiting on gloo's or the watch's threads


if __name__ == "__main__":
    sys.exit(main())

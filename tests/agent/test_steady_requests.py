"""A node's steady etcd traffic, counted by etcd itself: at most 2 requests a second at the defaults.

Two real agents (`marind agent`, default lease TTL, report interval and rendezvous settings)
run one job of two nodes (torchrun, one tiny worker each). Each agent (and so its torchrun)
talks to a member of its own of a two-member etcd cluster, so each member's
``grpc_server_msg_received_total`` counts one node's requests alone (the members' raft
traffic is not client gRPC). The count runs over a fixed number of the node's report
intervals, bracketed by its own record writes (a watch), and is divided by the time between
those two writes by the agent's own clock (their ``updated_at``; at least the nominal
intervals): counted by etcd, with no timing of the test's own.

The node without global rank 0 must stay within the floor (issue 31: keep-alives, the
report, the job watch's resync, torchrun's rendezvous keep-alive and ``num_nodes_waiting``
together, docs/perf.md "A thousand nodes"). The rank-0 node also writes the job's progress
(and the job's bookkeeping): its rate is printed, not bounded (amortized over the nodes).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading

from marind.control.jobs_client import JobsClient
from marind.core.etcd_client import EtcdClient
from marind.core.spec import load_spec
from marind.testing.etcd_cluster import EtcdCluster
from marind.testing.etcd_metrics import etcd_counters
from marind.testing.procs import kill_group
from tests.agent.helpers import start_agent, tiny_spec, wait_for

FLOOR = 2.0            # requests per second per node (issue 31)
REPORT_S = 2.0         # the agent's default report interval
WARM, COUNTED = 3, 4   # record writes skipped before the count, and report intervals counted


def test_a_nodes_steady_requests_stay_within_two_a_second(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd", size=2).start()
    prefix = "/steady"
    agents = []
    try:
        client = EtcdClient(cluster.members[0].endpoint, prefix=prefix)
        env = {"MARIND_RDZV_CONF": "", "MARIND_REPORT_INTERVAL": str(REPORT_S)}   # the defaults
        agents = [start_agent(tmp_path, f"n{i}", cluster.members[i].endpoint, prefix, slots=1, env=env)
                  for i in range(2)]
        spec = tiny_spec(tmp_path, name="steady", nodes="2:2", nproc=1, steps=100000)
        job = JobsClient(client).submit(load_spec(spec).to_dict(), "steady")
        member = {"n0": cluster.members[0].endpoint, "n1": cluster.members[1].endpoint}
        seen = {"n0": 0, "n1": 0}
        counts: dict[str, list[dict]] = {"n0": [], "n1": []}
        done = threading.Event()
        lock = threading.Lock()

        def on_event(response) -> None:
            for event in getattr(response, "events", []):     # an error (a broken watch) has none
                if event.value:
                    count(event.key.decode().rsplit("/", 1)[-1], json.loads(event.value)["updated_at"])

        def count(node: str, at: float) -> None:
            with lock:
                if node not in seen or len(counts[node]) > 1:
                    return
                seen[node] += 1
                if seen[node] in (WARM, WARM + COUNTED):
                    counts[node].append({**etcd_counters(member[node]), "at": at})
                if all(len(c) == 2 for c in counts.values()):
                    done.set()

        def running() -> bool:
            records = client.get_prefix_json(client.key("jobs", job, "nodes") + "/")
            return len(records) == 2 and all(r.get("workers") for r in records.values())
        wait_for(running, 240, "both nodes' workers running")
        watch = client.watch_prefix(client.key("jobs", job, "nodes") + "/", on_event)
        assert done.wait(120 + 10 * REPORT_S * (WARM + COUNTED)), f"record writes seen: {seen}"
        client.cancel_watch(watch)
        records = client.get_prefix_json(client.key("jobs", job, "nodes") + "/")
        rank0 = next(k.rsplit("/", 1)[-1] for k, r in records.items() if any(w["rank"] == 0 for w in r["workers"]))
        # per second of the agent's own clock between the two reports (its records' updated_at): at
        # least COUNTED report intervals, longer when a busy machine delays the agent's ticks
        rates = {node: (c[1]["requests"] - c[0]["requests"]) / max(COUNTED * REPORT_S, c[1]["at"] - c[0]["at"])
                 for node, c in counts.items()}
        other = next(n for n in rates if n != rank0)
        print(f"\netcd requests per second over {COUNTED} report intervals: {rates} (rank 0 on {rank0})")
        for node, c in counts.items():
            print(node, {k.split(":", 1)[1]: c[1][k] - c[0].get(k, 0.0) for k in c[1]
                         if k.startswith("requests:") and c[1][k] - c[0].get(k, 0.0)})
        assert rates[other] <= FLOOR, (other, rates)
        client.close()
    finally:
        for proc in agents:                      # a clean stop ends each agent's torchrun and workers
            proc.send_signal(signal.SIGTERM)
        for proc in agents:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_group(proc)
        cluster.stop()

"""An etcd outage longer than the lease TTL, with the peers still reachable: no fence, no restart.

Two agents (lease TTL 4 s) run one job; etcd is stopped while the job
trains and stays away for well over a TTL (counted in the workers' steps).
Nobody can renew a lease, but the workers keep stepping, so no agent fences
its run and none restarts (``decisions.fence_due``/``on_node_loss``); the
job finishes with no restart, no ``node_lost`` and no ``host_fenced``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from marind.core.etcd_client import EtcdClient
from marind.testing.procs import base_env
from tests.agent.helpers import agent_log, done_record, job_state, node_registered, start_agent, tiny_spec, wait_for


def test_an_outage_longer_than_the_ttl_restarts_nothing(tmp_path, etcd_private, monkeypatch):
    prefix = "/outage2"
    client = EtcdClient(etcd_private.endpoint, prefix=prefix)
    env = {"MARIND_LEASE_TTL": "4", "MARIND_TEST_STEP_SLEEP": "0.3"}
    for n in ("a", "b"):
        start_agent(tmp_path, n, etcd_private.endpoint, prefix, env=env)
    diag = lambda: f"--- a ---\n{agent_log(tmp_path, 'a')}\n--- b ---\n{agent_log(tmp_path, 'b')}"
    wait_for(lambda: node_registered(client, "a") and node_registered(client, "b"), 30, "two nodes", diag=diag)
    steps = 70     # the outage's 25 steps, then 40 or so (12 s, three TTLs) with etcd back: re-registered, no loss
    spec = tiny_spec(tmp_path, name="outage2", nodes="2:2", nproc=1, steps=steps, max_restarts=3,
                     hang_timeout="300s")
    res = subprocess.run([sys.executable, "-m", "marind", "submit", str(spec)], capture_output=True, text=True,
                         env=base_env({"MARIND_ETCD": etcd_private.endpoint, "MARIND_PREFIX": prefix}), timeout=60)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: (p := client.get_json(client.key("jobs", job, "progress")) or {}).get("world_size") == 2
             and p.get("step", 0) >= 3, 120, "the job running on two nodes", diag=diag)

    def local_steps():
        out = []
        for n in ("a", "b"):
            for f in (tmp_path / f"state-{n}" / "jobs" / job / "progress").glob("rank-*.json"):
                try:
                    out.append(json.loads(f.read_text())["step"])
                except (OSError, ValueError, KeyError):
                    out.append(-1)
        return out

    etcd_private.stop()
    try:
        at_outage = min(local_steps())
        assert steps - (at_outage + 25) >= 30, f"step {at_outage} at the outage: too few steps left after it"
        # 25 steps of 0.3 s: the outage outlasts the 4 s TTL by far
        wait_for(lambda: len(local_steps()) == 2 and min(local_steps()) >= at_outage + 25, 90,
                 "both nodes training through the outage", diag=diag)
    finally:
        etcd_private.start()
    wait_for(lambda: job_state(client, job).get("state") == "SUCCEEDED", 180, "SUCCEEDED after the outage",
             diag=lambda: f"{job_state(client, job)}\n{diag()}")
    assert done_record(spec)["step"] == steps
    kinds = [e["kind"] for e in client.get_prefix_json(client.key("jobs", job, "events") + "/").values()]
    for kind in ("restart", "node_lost", "host_fenced", "hang_detected"):
        assert kind not in kinds, kinds
    assert job_state(client, job).get("restarts", 0) == 0
    for n in ("a", "b"):
        assert "host_fenced" not in (tmp_path / f"agent-{n}.log").read_text()
    client.close()

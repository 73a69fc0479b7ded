"""What the job page shows, read from etcd: the whole cluster, or one job's history.

Both documents are plain JSON (``/api/cluster``, ``/api/jobs/JOB``); ``html`` renders them.
Every agent reads the same keys, so every agent's page shows the same cluster.
"""

from __future__ import annotations

import time
from typing import Any

from marind.agent.page.cluster_read import job_rows
from marind.control.events import list_events
from marind.control.job_history import ledger_from as _ledger_from
from marind.control.job_history import ledger_key, read_series
from marind.control.jobs_client import JobsClient
from marind.core.errors import NotFound
from marind.core.etcd_client import EtcdClient

_ROW_KEYS = ("id", "name", "state", "reason", "nodes", "world_size", "step", "target_steps", "loss",
             "tokens_per_s", "last_checkpoint_step", "restarts", "updated_at")


def cluster(client: EtcdClient, now: float | None = None) -> dict[str, Any]:
    """Every node (state, slots, jobs, last heartbeat) and every job (state, reason, step, restarts, goodput)."""
    now = time.time() if now is None else now
    jc = JobsClient(client)
    jobs = [{k: r.get(k) for k in _ROW_KEYS} | {"goodput": r["goodput"]} for r in job_rows(client)]
    nodes = []
    for n in jc.nodes():
        mine = [j["id"] for j in jobs if n["node"] in (j["nodes"] or [])]
        nodes.append({"node": n["node"], "host": n.get("host"), "slots": n.get("slots"), "version": n.get("version"),
                      "jobs": mine, "state": "up", "heartbeat_s": _heartbeat_age(client, n["node"]),
                      "started_at": n.get("started_at")})
    return {"at": now, "nodes": nodes, "jobs": jobs}


def _heartbeat_age(client: EtcdClient, node: str) -> float | None:
    """Seconds since the node's lease was last renewed (its granted TTL less what is left), if known."""
    lease = client.lease_of(client.key("nodes", node))
    ttl = client.lease_time_to_live(lease) if lease else None
    return None if ttl is None else float(ttl[1] - ttl[0])


def job(client: EtcdClient, job_id: str, now: float | None = None) -> dict[str, Any]:
    """One job: its row, curves, events, ledger and committed checkpoints (``NotFound``: no such job)."""
    now = time.time() if now is None else now
    row = JobsClient(client).job(job_id)
    events = list_events(client, job_id)
    ledger = _ledger_from(client.get_json(ledger_key(client, job_id)), events, now)
    series = read_series(client, job_id)
    x0 = ledger["start"] if ledger["start"] is not None else min([e["at"] for e in events] + [now])
    x1 = ledger["end"] if ledger["final"] and ledger["end"] else now
    checkpoints = [{"step": (e.get("detail") or {}).get("step"), "at": e["at"],
                    "duration_s": (e.get("detail") or {}).get("duration_s"), "node": e.get("node")}
                   for e in events if e.get("kind") == "checkpoint_committed"]
    return {"at": now, "job": {k: row.get(k) for k in _ROW_KEYS} | {"goodput": ledger["goodput"]},
            "x0": x0, "x1": max(x1, x0 + 1), "series": series, "events": events, "ledger": ledger,
            "checkpoints": checkpoints}


def job_or_none(client: EtcdClient, job_id: str) -> dict[str, Any] | None:
    try:
        return job(client, job_id)
    except NotFound:
        return None

"""Every job's row for the cluster page, read in a few etcd transactions rather than a few reads per job.

The rows carry what ``JobsClient.job`` shows (state, reason, step, restarts, nodes, ...) and
the stored ledger's goodput; ``BATCH`` jobs per transaction (six reads each, under etcd's
default limit of 128 operations), so a cluster of 100 jobs is 6 round trips.
"""

from __future__ import annotations

import json
from typing import Any

from marind.control.job_history import ledger_key
from marind.control.job_records import job_state_key, list_job_ids
from marind.control.jobs_client import row_reason
from marind.control.lifecycle import JobState, StateRecord
from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient

#: Jobs per transaction.
BATCH = 20
_PARTS = ("spec", "state", "progress", "last_error", "ledger")


def _json(raw: bytes | None) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _obj(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def job_rows(client: EtcdClient) -> list[dict[str, Any]]:
    """Every job's row, in submission order (a job removed between the listing and the read is left out)."""
    ids = list_job_ids(client)
    rows = []
    for i in range(0, len(ids), BATCH):
        batch = ids[i:i + BATCH]
        ops = []
        for job in batch:
            ops += [tx.get(client.key("jobs", job, "spec")), tx.get(job_state_key(client, job)),
                    tx.get(client.key("jobs", job, "progress")), tx.get(client.key("jobs", job, "last_error")),
                    tx.get(ledger_key(client, job)), tx.keys(client.key("jobs", job, "nodes") + "/")]
        resp = client.txn([], ops)
        for j, job in enumerate(batch):
            base = j * (len(_PARTS) + 1)
            kvs = [resp.responses[base + k].response_range.kvs for k in range(len(_PARTS))]
            if not kvs[0]:
                continue
            parts = {name: _json(kv[0].value) if kv else None for name, kv in zip(_PARTS, kvs)}
            nodes = sorted(kv.key.decode().rsplit("/", 1)[-1] for kv in resp.responses[base + 5].response_range.kvs)
            rows.append(row(job, parts, nodes, submitted_rev=int(kvs[0][0].mod_revision)))
    return sorted(rows, key=lambda r: r["submitted_rev"])


def row(job: str, parts: dict[str, Any], nodes: list[str], submitted_rev: int = 0) -> dict[str, Any]:
    """One job's row from its keys' values (pure)."""
    spec: dict = _obj(parts.get("spec"))
    state = StateRecord.from_dict(parts["state"]) if isinstance(parts.get("state"), dict) \
        else StateRecord(JobState.PENDING)
    progress: dict = _obj(parts.get("progress"))
    ledger: dict = _obj(_obj(parts.get("ledger")).get("ledger"))
    steps = _obj(spec.get("train")).get("steps")
    reported = progress.get("step")
    step = reported if state.step is None else (state.step if reported is None else max(int(reported), state.step))
    return {"id": job, "name": _obj(spec.get("job")).get("name"),
            "state": state.state.value,
            "reason": row_reason(state.state.value, state.reason, parts.get("last_error"), progress.get("checkpoint_error")),
            "nodes": nodes, "world_size": progress.get("world_size") or 0, "step": step,
            "target_steps": steps, "loss": progress.get("loss"), "tokens_per_s": progress.get("tokens_per_s"),
            "last_checkpoint_step": progress.get("last_checkpoint_step"), "restarts": state.restarts,
            "updated_at": max(state.updated_at, float(progress.get("updated_at") or 0)),
            "goodput": ledger.get("goodput"),
            "submitted_rev": submitted_rev}

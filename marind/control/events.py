"""The bounded event ring ``{p}/jobs/{job}/events/{seq:012d}`` (docs/design.md §2).

``seq`` comes from a counter key (``{p}/jobs/{job}/event_seq``) bumped by
compare-and-swap, so concurrent agents never reuse a number. After each
append, events older than ``keep`` numbers are deleted.
"""

from __future__ import annotations

import json
import time

from marind.core.etcd_client import EtcdClient

DEFAULT_KEEP = 200

#: torchft: a replica group's state differed from the others' at a drift check (``{replica_group,
#: step, reason, healed}``; once when found, once more when healed; ``marind.trainer.ft.drift``).
REPLICA_DRIFT = "replica_drift"
#: a rank persistently slower than the job's median (``{node, ranks, compute_s, median_s, factor,
#: window_s, reason}``; ``marind.agent.stragglers``), and its end (``{node, ranks}``).
STRAGGLER = "straggler"
STRAGGLER_CLEARED = "straggler_cleared"

#: An agent would not run the job: ``{reason, key_id}``. With ``[agent] require_signed_jobs``, a
#: job whose spec is unsigned, or not signed by a key of ``[agent] trusted_keys``, is refused: the
#: agent that moves it to FAILED (reason ``refused: ...``) writes this event; nothing runs
#: (``marind.agent.job_trust``, docs/design.md §2).
JOB_REFUSED = "job_refused"

#: Memory checkpoints (``[checkpoint] memory_every``): a restart could not restore the newest memory
#: step (its host and the host of its replica lost together, or its load failed) and fell back to
#: the durable store: ``{step (restored, or null), lost_step, reason}`` (global rank 0's record;
#: ``marind.trainer.memory_ckpt``). Once per restore.
CHECKPOINT_MEMORY_FALLBACK = "checkpoint_memory_fallback"


#: A checkpoint save of the job failed (global rank 0's record said why): ``{step, reason}``, the
#: reason naming the kind (a full checkpoint volume, an object store past its retry budget) and the
#: fix (``ckpt_store.errors.failure_reason``); training goes on. Once per failed save.
CHECKPOINT_FAILED = "checkpoint_failed"


def event_key(client: EtcdClient, job: str, seq: int) -> str:
    return client.key("jobs", job, "events", f"{seq:012d}")


def append_event(client: EtcdClient, job: str, kind: str, node: str, detail: dict | str | None = None,
                 *, keep: int = DEFAULT_KEEP, now: float | None = None) -> int:
    """Write one event; returns its sequence number."""
    counter = client.key("jobs", job, "event_seq")
    for _ in range(50):
        raw, rev = client.get(counter)
        seq = int(raw) + 1 if raw else 1
        ok, _ = client.compare_and_swap(counter, str(seq), rev)
        if ok:
            break
    else:
        raise RuntimeError(f"could not allocate an event number for job {job} (contention)")
    client.put_json(event_key(client, job, seq), {
        "at": time.time() if now is None else now, "kind": kind, "node": node, "detail": detail or {}})
    old = seq - keep
    if old >= 1:
        client.delete(event_key(client, job, old))
    return seq


def list_events(client: EtcdClient, job: str) -> list[dict]:
    rows = client.get_prefix(client.key("jobs", job, "events") + "/")
    out = []
    for key, value, _ in sorted(rows):
        try:
            item = json.loads(value)
        except ValueError:
            continue
        item["seq"] = int(key.rsplit("/", 1)[-1])
        out.append(item)
    return out

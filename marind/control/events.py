"""The bounded event ring ``{p}/jobs/{job}/events/{n:012d}`` (docs/design.md §2).

An append costs two requests however many writers append at once, and none
waits or retries for another's sake:

1. a number ``n``: a put of the counter key ``{p}/jobs/{job}/event_seq`` that asks
   etcd for the key as it was; its ``version`` + 1 is ``n``. etcd applies puts one
   by one, so no two appends get the same number (the compare-and-swap this
   replaced cost each of N writers at once O(N) tries, and gave up after 50);
2. one transaction: the event at ``events/{n:012d}``, and the removal of every
   number up to ``n - keep`` (one range delete: the ring stays bounded, and an
   event of a slower writer numbered before others is swept by the next append).

The order readers see is etcd's: an event's ``seq`` is its key's create revision.
Events are listed in the order etcd wrote them, a read at a revision sees every
event written up to it (a follower goes on from the last ``seq`` it saw, and
misses none), and the order never changes. The numbers only bound the ring; one
taken by a writer that died before its event is a gap.
"""

from __future__ import annotations

import json
import time

from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient

DEFAULT_KEEP = 200

#: torchft: a replica group's state differed from the others' at a drift check (``{replica_group,
#: step, reason, healed}``; once when found, once more when healed; ``marind.trainer.ft.drift``).
REPLICA_DRIFT = "replica_drift"
#: a rank persistently slower than the job's median (``{node, ranks, compute_s, median_s, factor,
#: window_s, reason}``; ``marind.agent.stragglers``), and its end (``{node, ranks}``).
STRAGGLER = "straggler"
STRAGGLER_CLEARED = "straggler_cleared"
#: ``[fault] straggler_action = "exclude"``: a straggler's node taken out of the job (``{node, ranks,
#: compute_s, median_s, reason}``; ``marind.control.job_exclusions``); its agent then leaves the job.
STRAGGLER_EXCLUDED = "straggler_excluded"

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


#: The agent's state dir (its run dirs: torchrun's output, progress, curves) filled up: ``{path,
#: free_bytes, error, where, effect[, action]}`` on each job the agent runs, once per episode, and
#: on a job it did not start because of it (``action``); running jobs go on, their output is dropped
#: (``marind.agent.state_dir``).
STATE_DIR_FULL = "state_dir_full"
#: ... and space came back: ``{path, free_bytes, full_s, dropped}`` on the same jobs; the writes
#: go on from now (nothing dropped is made up for).
STATE_DIR_RECOVERED = "state_dir_recovered"


def event_key(client: EtcdClient, job: str, n: int) -> str:
    """The key of the job's event numbered ``n`` (its place in the ring, not its ``seq``)."""
    return client.key("jobs", job, "events", f"{n:012d}")


def _events_prefix(client: EtcdClient, job: str) -> str:
    return client.key("jobs", job, "events") + "/"


def _counter_key(client: EtcdClient, job: str) -> str:
    return client.key("jobs", job, "event_seq")


def append_event(client: EtcdClient, job: str, kind: str, node: str, detail: dict | str | None = None,
                 *, keep: int = DEFAULT_KEEP, now: float | None = None) -> int:
    """Write one event and trim the ring to the newest ``keep`` numbers; returns its ``seq``.

    Two requests (the module docstring), however many writers append at once.

    Args:
        client: the etcd client (``ControlPlaneUnavailable`` propagates).
        job: the job's id.
        kind: the event's kind (``restart``, ``node_lost``, ...).
        node: who writes it (a node, or ``user@host``); also the counter's value.
        detail: the event's details.
        keep: how many numbers the ring keeps (>= 1).
        now: the event's time (default: now).

    Returns:
        The event's ``seq``: its create revision, its place in the job's order.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    taken = client.txn([], [tx.put(_counter_key(client, job), node, prev_kv=True)])
    n = tx.prev_version_of(taken, 0) + 1
    value = json.dumps({"at": time.time() if now is None else now, "kind": kind, "node": node,
                        "detail": detail or {}}, sort_keys=True)
    ops = [tx.put(event_key(client, job, n), value)]
    if n > keep:
        ops.append(tx.delete_range(_events_prefix(client, job), event_key(client, job, n - keep + 1)))
    return int(client.txn([], ops).header.revision)


def list_events(client: EtcdClient, job: str, *, after: int = 0) -> list[dict]:
    """The job's events in its order (``seq`` ascending), each ``{at, kind, node, detail, seq}``.

    Args:
        client: the etcd client.
        job: the job's id.
        after: only the events after this ``seq`` (the last one a reader saw; etcd filters them).

    Returns:
        The events, oldest first; one read at one revision.
    """
    response = client.txn([], [tx.values(_events_prefix(client, job), created_after=after)])
    out = []
    for _, value, created in sorted(tx.created_values_of(response, 0), key=lambda row: row[2]):
        try:
            item = json.loads(value)
        except ValueError:
            continue
        if isinstance(item, dict):
            item["seq"] = created
            out.append(item)
    return out


def events_numbered(client: EtcdClient, job: str) -> int:
    """How many event numbers the job's appends have taken (each append one; benches count by it)."""
    response = client.txn([], [tx.get(_counter_key(client, job))])
    kvs = response.responses[0].response_range.kvs
    return int(kvs[0].version) if kvs else 0

"""A job's history as readers see it: its goodput ledger and its curves (docs/design.md §11).

The agent of global rank 0 keeps ``{p}/jobs/{job}/ledger`` (the ledger's fold state,
``goodput_ledger.LedgerState``, with the events it folded up to ``seq``) and
``{p}/jobs/{job}/series`` (``job_series``). A reader folds the events written since (a
failure noticed by another node, the terminal event) into the stored state and closes it at
the job's end or now: ``marind status``, ``marind events --json``, the job page.
"""

from __future__ import annotations

import time
from typing import Any

from marind.control import goodput_ledger as gl
from marind.control import job_series
from marind.control.events import list_events
from marind.core.etcd_client import EtcdClient


def ledger_key(client: EtcdClient, job: str) -> str:
    return client.key("jobs", job, "ledger")


def series_key(client: EtcdClient, job: str) -> str:
    return client.key("jobs", job, "series")


def start_ledger(client: EtcdClient, job: str, at: float | None = None) -> None:
    """At submission: the ledger starts, waiting for nodes (``waiting`` until a node joins)."""
    now = time.time() if at is None else at
    client.put_json(ledger_key(client, job), {"state": gl.LedgerState(start=now, t=now, mode="waiting").to_dict()})


def ledger_from(stored: Any, events: list[dict], now: float) -> dict[str, Any]:
    """The ledger shown: the stored fold state (or none) with ``events`` folded in, closed at ``now`` (pure)."""
    state = gl.LedgerState.from_dict(stored.get("state") if isinstance(stored, dict) else None)
    return gl.close(gl.fold(state, events, []), now)


def read_ledger(client: EtcdClient, job: str, events: list[dict] | None = None,
                now: float | None = None) -> dict[str, Any]:
    """The job's ledger now (``events``: the job's events when already read)."""
    stored = client.get_json(ledger_key(client, job))
    if events is None:
        events = list_events(client, job)
    return ledger_from(stored, events, time.time() if now is None else now)


def read_series(client: EtcdClient, job: str) -> dict[str, Any]:
    """The job's curves (``{res_s, points}``; empty when none was written)."""
    return job_series.parse(client.get_json(series_key(client, job)))

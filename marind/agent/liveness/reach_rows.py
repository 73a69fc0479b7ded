"""A job's data-reachability rows in etcd: one key per node, put when it changes, read from a watch.

Each node of a job publishes its row (``data_decisions.ReachRow``: its data endpoint and its
probe listener's token, its link's carrier, the peers it probes and since when each has not
answered steadily) at ``{p}/jobs/{job}/reach/{node}``, under its node lease. The row is put only
when something in it but its time changed, and every node keeps the job's rows from one read
and then a watch of the prefix, which brings the rows that changed and no others. A row costs
etcd O(N) bytes when it changes (its watchers) and nothing while it does not.

Before (issue 31), the row rode in the node's job record, rewritten every report, and reached
the other nodes only with a full read of every record every 30 s: N² records per 30 s across
the job, and for 20 of those 30 s older than the freshness the decisions ask (the lease TTL).

A row is fresh while its key exists and its node has a record in the job: it lives under its
node's lease, so the row of a node that is away goes within a lease TTL, the freshness the
decisions used before, and a node that left the job has no say even while a row of it stays.
An agent whose loop stalls while its lease thread renews keeps its last row: its sd_notify
watchdog (``WatchdogSec=60``) restarts it. No row is put without a lease.
"""

from __future__ import annotations

import json
from typing import Any

from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient
from marind.core.etcd_watch import PrefixWatch
from marind.core.log import get_logger

log = get_logger(__name__)


def reach_prefix(client: EtcdClient, job: str) -> str:
    """``{p}/jobs/{job}/reach/``: one row per node of the job."""
    return client.key("jobs", job, "reach") + "/"


def row_changed(row: dict, published: dict | None) -> bool:
    """Does ``row`` say something the last published row did not (its time ``at`` aside)? (pure)"""
    return published is None or {k: v for k, v in row.items() if k != "at"} != \
        {k: v for k, v in published.items() if k != "at"}


class ReachRows:
    """One node's part in a job's rows: its own row put, everyone's kept (``close`` it with the run).

    Args:
        client: the etcd client.
        job: the job's id.
        node: this node's name.
    """

    def __init__(self, client: EtcdClient, job: str, node: str) -> None:
        self.client, self.job, self.node = client, job, node
        self.prefix = reach_prefix(client, job)
        #: node -> its row as last read or watched
        self.rows: dict[str, dict] = {}
        self._watch = PrefixWatch(client, self.prefix)
        self._read_rev: int | None = None        # None: read the whole prefix at the next refresh
        self._published: tuple[dict, int] | None = None   # (row, lease id) last put

    def publish(self, row: dict, lease: Any) -> bool:
        """Put this node's row when it changed, or the lease it lives under did (raises ControlPlaneUnavailable).

        Returns:
            Whether it was put.
        """
        if lease is None:
            return False                              # no lease, no row: it would outlive the node
        lease_id = int(lease.id)
        if self._published is not None and self._published[1] == lease_id and not row_changed(row, self._published[0]):
            return False
        self.client.put(self.prefix + self.node, json.dumps(row, sort_keys=True), lease)
        self._published = (row, lease_id)
        return True

    def refresh(self) -> dict[str, dict]:
        """The job's rows by node, as of now (raises ControlPlaneUnavailable).

        The whole prefix is read at the first call and whenever the watch (re)started; in
        between, the watch's events are applied in order, those the last read saw already left out.
        """
        if self._watch.ensure() or not self._watch.live:
            self._read_rev = None
        events = self._watch.take()
        if self._read_rev is None:
            self._read_all()
            return self.rows
        for event in events:
            if int(event.mod_revision) <= self._read_rev:
                continue                              # the read had it
            node = event.key.decode()[len(self.prefix):]
            if type(event).__name__ == "DeleteEvent":
                self.rows.pop(node, None)
                continue
            row = _parse(event.value)
            if row is not None:
                self.rows[node] = row
        return self.rows

    def _read_all(self) -> None:
        """Every row, and the revision they are as of (one request)."""
        resp = self.client.txn([], [tx.values(self.prefix)])
        rows = {key[len(self.prefix):]: row for key, raw in tx.values_of(resp, 0) if (row := _parse(raw)) is not None}
        self.rows, self._read_rev = rows, int(resp.header.revision)

    def close(self, drop: bool = True) -> None:
        """Stop watching; ``drop``: delete this node's row (best effort: it goes with the lease anyway)."""
        self._watch.close()
        if drop and self._published is not None:
            try:
                self.client.delete(self.prefix + self.node)
            except Exception as exc:  # noqa: BLE001 - etcd away: the lease takes the row
                log.info("reach_row_drop_failed", job=self.job, error=f"{type(exc).__name__}: {exc}")


def _parse(raw: bytes) -> dict | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

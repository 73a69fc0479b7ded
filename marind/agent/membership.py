"""Which nodes left a job, and how: one ``node_lost`` event per lost node, whoever notices.

Each node of a job keeps ``{p}/jobs/{job}/nodes/{node}`` under its lease,
with the pid of its agent (``agent_pid``): one incarnation of the node (an
agent that registered anew after a fence writes ``incarnation``:
``{agent_pid}.{registration}``, so a second loss is a new one).
An agent that ends its part cleanly first writes
``{p}/jobs/{job}/departed/{node}/{agent_pid}`` (``how: "left"``), then
deletes its record; an agent that dies just loses its record when its lease
expires, or has it replaced by its next incarnation. Every agent of the job
compares the incarnations it sees with the ones it saw before (``poll``):
one that vanished without a clean leave is a ``Loss``, with its last record
and the cause. The agent decides what the loss means for its workers
(``decisions.on_node_loss``) and, when it acts on it, ``claim``\\ s it: it
tries to *create* the departed key (``how: "lost"``); only the agent whose
create succeeds emits the event, so a loss is recorded once, even when the
node of global rank 0 is the one that died. ``mark_lost`` tells the
rendezvous to drop the node's torchrun at once (``rdzv/lost/{desc}``, see
``marind.rendezvous.handler``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import lost_key, members_key, round_key

#: reports between two full reads of a job's node records (``Membership.report``)
FULL_READ_EVERY = 15

#: ``Loss.cause`` values.
LEASE_EXPIRED = "lease_expired"          # its node registration is gone too: silent, powered off, cut off
AGENT_RESTARTED = "agent_restarted"      # a new incarnation of its agent replaced the record
RECORD_DROPPED = "record_dropped"        # its job record went while the node stays registered


def vanished(before: dict[str, str], now: dict[str, str], me: str) -> list[tuple[str, str]]:
    """(node, incarnation) seen before and gone or replaced now, except this node's (pure)."""
    return sorted((node, inc) for node, inc in before.items() if node != me and now.get(node) != inc)


def loss_cause(replaced: bool, registration: dict | None, incarnation: str) -> str:
    """Why a node's job record vanished (pure).

    Args:
        replaced: a record of another incarnation took its place.
        registration: the node's ``{p}/nodes/{node}`` now, or None.
        incarnation: the vanished incarnation (its agent's pid, ``.{registration}`` after the first).

    Returns:
        ``LEASE_EXPIRED``, ``AGENT_RESTARTED`` or ``RECORD_DROPPED``.
    """
    if replaced or (registration is not None and str(registration.get("pid")) != incarnation.split(".")[0]):
        return AGENT_RESTARTED
    return LEASE_EXPIRED if registration is None else RECORD_DROPPED


@dataclass(frozen=True)
class Loss:
    """A node's incarnation gone from the job without a clean leave."""

    node: str
    incarnation: str
    cause: str
    record: dict = field(default_factory=dict, compare=False)   # its last job record seen

    @property
    def in_round(self) -> bool:
        """It ran workers when last seen."""
        return bool(self.record.get("workers"))


class Membership:
    """One agent's view of one job's nodes."""

    def __init__(self, client: EtcdClient, job: str, node: str, incarnation: str):
        self.client, self.job, self.node, self.incarnation = client, job, node, str(incarnation)
        self.known: dict[str, str] = {}
        self.records: dict[str, dict] = {}
        self._primed: dict[str, Any] | None = None     # the records the last report read (``report``)
        self._last_read: dict[str, Any] = {}            # the last full read of them, and its revision
        self._read_rev: int | None = None
        self._since_full = 0                            # reports since

    def _departed_key(self, node: str, incarnation: str) -> str:
        return self.client.key("jobs", self.job, "departed", node, incarnation)

    def leaving(self, why: str) -> None:
        """This node ends its part cleanly: the others must not report it lost."""
        self.client.put(self._departed_key(self.node, self.incarnation),
                        json.dumps({"how": "left", "reason": why, "at": time.time()}))

    @property
    def prefix(self) -> str:
        """Where the job's node records are: ``{p}/jobs/{job}/nodes/``."""
        return self.client.key("jobs", self.job, "nodes") + "/"

    def report(self, put: Any) -> None:
        """One report's transaction: ``put`` (this node's record), and the job's node records for
        the next ``poll``: read back whole only when a record was created since the last full
        read (a node joined or came back), when one is gone (the count fell: a second request),
        and every ``FULL_READ_EVERY`` reports (a record put over another incarnation's without
        a delete changes neither); otherwise only their count comes back and the poll sees the
        last full read again. So a steady report costs etcd O(1) bytes, not the job's N records.
        Raises ControlPlaneUnavailable.
        """
        c = self.client
        if self._read_rev is None or self._since_full >= FULL_READ_EVERY:
            self._full(c.txn([], [put, tx.values(self.prefix)]), 1)
            return
        resp = c.txn([tx.created_before(self.prefix, self._read_rev + 1)],
                     [put, tx.count(self.prefix, prefix=True)], [put, tx.values(self.prefix)])
        if not resp.succeeded:
            self._full(resp, 1)
        elif tx.count_of(resp, 1) != len(self._last_read):
            self._full(c.txn([], [tx.values(self.prefix)]), 0)
        else:
            self._since_full += 1
            self._primed = dict(self._last_read)

    def _full(self, resp: Any, index: int) -> None:
        read: dict[str, Any] = {}
        for key, raw in tx.values_of(resp, index):
            try:
                read[key] = json.loads(raw)
            except ValueError:
                continue
        self._primed, self._last_read = read, dict(read)
        self._read_rev, self._since_full = int(resp.header.revision), 0

    def poll(self, read: dict[str, Any] | None = None) -> list[Loss]:
        """Incarnations gone since the last poll without a clean leave (raises ControlPlaneUnavailable).

        Args:
            read: the job's node records by key, as read already; None: those the last
                ``report_record`` read, if no poll used them yet, else read them here.
        """
        if read is None:
            read, self._primed = self._primed, None
        read = self.client.get_prefix_json(self.prefix) if read is None else read
        records = {key.rsplit("/", 1)[-1]: rec for key, rec in read.items() if isinstance(rec, dict)}
        now = {node: str(rec.get("incarnation", rec.get("agent_pid", "?"))) for node, rec in records.items()}
        losses = []
        for node, inc in vanished(self.known, now, self.node):
            departed = self.client.get_json(self._departed_key(node, inc))
            if isinstance(departed, dict) and departed.get("how") == "left":
                continue
            registration = self.client.get_json(self.client.key("nodes", node))
            cause = loss_cause(node in now, registration if isinstance(registration, dict) else None, inc)
            losses.append(Loss(node, inc, cause, self.records.get(node, {})))
        self.known, self.records = now, records
        return losses

    def present(self, loss: Loss) -> bool:
        """The lost incarnation's record is back (as of the last poll): it was never gone for good."""
        return self.known.get(loss.node) == loss.incarnation

    def claim(self, loss: Loss, detail: dict) -> bool:
        """Record the loss once: True for the one agent whose create of the departed key succeeds."""
        return self.client.create(self._departed_key(loss.node, loss.incarnation),
                                  json.dumps({"how": "lost", "seen_by": self.node, "cause": loss.cause,
                                              "at": time.time(), **detail}))

    def rdzv_desc(self, loss: Loss) -> str | None:
        """The lost torchrun's rendezvous node descriptor, or None when it never published one."""
        member = self.client.get_json(members_key(self.client, self.job, loss.node))
        if not isinstance(member, dict) or not member.get("desc"):
            return None
        if str(member.get("pid")) != str(loss.record.get("torchrun_pid", member.get("pid"))):
            return None      # a later torchrun of that node published since: not the lost one
        return str(member["desc"])

    def in_current_round(self, loss: Loss, desc: str | None) -> bool:
        """Was the lost torchrun a participant of the job's last completed rendezvous round?

        Read from ``rdzv/round`` (published by each round's rank 0); without it or without
        the descriptor, from the node's last record (it ran workers).
        """
        current = self.client.get_json(round_key(self.client, self.job))
        if desc is None or not isinstance(current, dict) or not isinstance(current.get("participants"), list):
            return loss.in_round
        return desc in current["participants"]

    def declared_lost(self, torchrun_pid: int | None) -> bool:
        """Did the other agents declare this node's torchrun ``torchrun_pid`` lost?

        True when a ``departed`` claim (``how: "lost"``) names this incarnation, or when
        the descriptor this torchrun published is marked in ``rdzv/lost/``: its world was
        replaced while it was away, so its exit is a fence, never the job's failure.
        Raises ControlPlaneUnavailable.
        """
        departed = self.client.get_json(self._departed_key(self.node, self.incarnation))
        if isinstance(departed, dict) and departed.get("how") == "lost":
            return True
        member = self.client.get_json(members_key(self.client, self.job, self.node))
        if not isinstance(member, dict) or not member.get("desc") or str(member.get("pid")) != str(torchrun_pid):
            return False
        return self.client.get_json(lost_key(self.client, self.job, str(member["desc"]))) is not None

    def mark_lost(self, loss: Loss, desc: str | None) -> None:
        """Tell the rendezvous the node's torchrun is gone: ``rdzv/lost/{desc}`` (put; idempotent)."""
        if desc is not None:
            self.client.put_json(lost_key(self.client, self.job, desc),
                                 {"node": loss.node, "cause": loss.cause, "by": self.node, "at": time.time()})


def report_record(client: EtcdClient, job: str, node: str, record: dict, lease: Any,
                  members: Membership | None) -> None:
    """Write this node's record of ``job`` (under ``lease``) and, with ``members``, learn in the same
    transaction what the next ``members.poll()`` needs (``Membership.report``): one etcd request
    per report, and the job's records read back only when one came or went (docs/perf.md, "A
    thousand nodes").

    Args:
        client: the etcd client.
        job: the job's id.
        node: this node's name.
        record: the record (``RunMonitor.node_record``).
        lease: the node's lease (its keys vanish with it), or None.
        members: the job's membership watch (None: the record alone is written).

    Raises:
        ControlPlaneUnavailable: etcd is unreachable.
    """
    put = tx.put(client.key("jobs", job, "nodes", node), json.dumps(record, sort_keys=True),
                 lease.id if lease is not None else 0)
    if members is None:
        client.txn([], [put])
    else:
        members.report(put)

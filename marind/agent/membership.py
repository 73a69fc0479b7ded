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

What each agent reads of the job's records stays O(1) per report, and O(1) per node that
joins or leaves (docs/design.md §7, "10,000 nodes, on paper", item 2): ``report`` keeps a view
of the records, learns the ones created since its last read in the report's own transaction
(etcd's range filter on creation revisions), and the ones deleted from a watch of deletes
alone, each with the record's last value (``PrefixWatch``); the whole prefix is read only at
the first report, after the watch broke, and when the count etcd gives disagrees with the
view. A new incarnation deletes a record its node's earlier one left before it writes its own
(``_drop_other_incarnation``), so a replaced record is a delete the others see, never a put
over it that changes nothing they count. The view's records are as they were created (their
``workers``, ``step`` are not kept fresh: a lost node's last record comes with its delete);
the data network's rows, which must be fresh, have keys of their own
(``marind.agent.liveness.reach_rows``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient
from marind.core.etcd_watch import PrefixWatch
from marind.core.rdzv_keys import lost_key, members_key, rank_key, round_key

#: a report whose count says a record went waits this long at most for the watch's delete
#: event (on its way: etcd made the delete before the report) before reading every record
DELETE_WAIT_S = 1.0

#: ``Loss.cause`` values.
LEASE_EXPIRED = "lease_expired"          # its node registration is gone too: silent, powered off, cut off
AGENT_RESTARTED = "agent_restarted"      # a new incarnation of its agent replaced the record
RECORD_DROPPED = "record_dropped"        # its job record went while the node stays registered


def vanished(before: dict[str, str], now: dict[str, str], me: str) -> list[tuple[str, str]]:
    """(node, incarnation) seen before and gone or replaced now, except this node's (pure)."""
    return sorted((node, inc) for node, inc in before.items() if node != me and now.get(node) != inc)


def incarnation_of(record: dict) -> str:
    """The incarnation a job record names (its agent's pid before the first fence) (pure)."""
    return str(record.get("incarnation", record.get("agent_pid", "?")))


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
    """One agent's view of one job's nodes (``close`` it with the run: it holds a watch)."""

    def __init__(self, client: EtcdClient, job: str, node: str, incarnation: str):
        self.client, self.job, self.node, self.incarnation = client, job, node, str(incarnation)
        self.known: dict[str, str] = {}
        self.records: dict[str, dict] = {}
        self._primed: dict[str, Any] | None = None      # the records the last report read (``report``)
        self._view: dict[str, tuple[int, Any]] = {}      # key -> (creation revision, record) ...
        self._read_rev: int | None = None                # ... as of this revision
        self._own_checked = False                        # a record of an earlier incarnation dropped
        self._deletes = PrefixWatch(client, self.prefix, deletes_only=True)
        self._later: list[Any] = []                      # delete events past the last report's revision
        self._last: dict[str, dict] = {}                 # node -> its deleted record's last value

    def _departed_key(self, node: str, incarnation: str) -> str:
        return self.client.key("jobs", self.job, "departed", node, incarnation)

    def leaving(self, why: str) -> None:
        """This node ends its part cleanly: the others must not report it lost."""
        self.client.put(self._departed_key(self.node, self.incarnation),
                        json.dumps({"how": "left", "reason": why, "at": time.time()}))

    def close(self) -> None:
        """Cancel the watch of deletes for good (a later report reads as without one)."""
        self._deletes.close()

    @property
    def prefix(self) -> str:
        """Where the job's node records are: ``{p}/jobs/{job}/nodes/``."""
        return self.client.key("jobs", self.job, "nodes") + "/"

    def report(self, put: Any) -> None:
        """One report's transaction: ``put`` (this node's record), and what the next ``poll`` needs
        of the job's node records, at O(1) bytes per report and per node that came or went:

        * while no record was created since the last read (etcd's range compare on creation
          revisions), only their count comes back; otherwise, in the same request, the records
          created since (a node joined or came back), and no other;
        * a record deleted (a clean leave, an expired lease) comes from the watch of deletes,
          with its last value; a report whose count says one went before its event came waits
          ``DELETE_WAIT_S`` at most for it;
        * every record is read back, in the report's request, at the first report and after the
          watch (re)started; in a second request when the count still disagrees with the view.

        Raises ControlPlaneUnavailable.
        """
        c = self.client
        if not self._own_checked:
            self._drop_other_incarnation()
            self._own_checked = True
        if self._deletes.ensure():
            self._read_rev = None          # a new watch: a delete before it is in none of its events
        if self._read_rev is None:
            self._full(c.txn([], [put, tx.values(self.prefix)]), 1)
            return
        resp = c.txn([tx.created_before(self.prefix, self._read_rev + 1)], [put, tx.count(self.prefix, prefix=True)],
                     [put, tx.count(self.prefix, prefix=True), tx.values(self.prefix, created_after=self._read_rev)])
        rev, count = int(resp.header.revision), tx.count_of(resp, 1)
        if not resp.succeeded:
            self._view.update((key, (created, _parse(raw))) for key, raw, created in tx.created_values_of(resp, 2))
        self._apply_deletes(rev)
        deadline = time.monotonic() + DELETE_WAIT_S
        while count < len(self._view) and self._deletes.live and time.monotonic() < deadline:
            self._deletes.wait(deadline - time.monotonic())
            self._apply_deletes(rev)
        if count != len(self._view):
            self._full(c.txn([], [tx.values(self.prefix)]), 0)
            return
        self._read_rev = rev
        self._primed = {key: rec for key, (_, rec) in self._view.items()}

    def _drop_other_incarnation(self) -> None:
        """Delete this node's record when another incarnation wrote it (an agent that restarted
        within its old lease's TTL, or registered anew after a fence): the others' watch of
        deletes sees it go, with its last value (the loss), before this incarnation's put."""
        key = self.prefix + self.node
        raw, mod_revision = self.client.get(key)
        if raw is None:
            return
        record = _parse(raw)
        if not isinstance(record, dict) or incarnation_of(record) != self.incarnation:
            self.client.delete_if(key, mod_revision)

    def _apply_deletes(self, rev: int) -> None:
        """Drop from the view each record the watch saw deleted at revision ``rev`` or before (keep
        its last value for the poll's ``Loss``); later deletes wait for a later report."""
        events, self._later = [*self._later, *self._deletes.take()], []
        for event in events:
            deleted_at = int(event.mod_revision)
            if deleted_at > rev:
                self._later.append(event)
                continue
            key = event.key.decode()
            held = self._view.get(key)
            if held is not None and held[0] < deleted_at:       # not a record created after the delete
                del self._view[key]
            last = _parse(event.prev_value)
            if isinstance(last, dict):                          # (``poll`` matches its incarnation)
                self._last[key.rsplit("/", 1)[-1]] = last

    def _full(self, resp: Any, index: int) -> None:
        self._view = {key: (created, _parse(raw)) for key, raw, created in tx.created_values_of(resp, index)}
        self._primed = {key: rec for key, (_, rec) in self._view.items()}
        self._read_rev = int(resp.header.revision)
        self._apply_deletes(self._read_rev)          # (those before the read: the view holds none of them)

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
        now = {node: incarnation_of(rec) for node, rec in records.items()}
        losses = []
        for node, inc in vanished(self.known, now, self.node):
            departed = self.client.get_json(self._departed_key(node, inc))
            if isinstance(departed, dict) and departed.get("how") == "left":
                continue
            registration = self.client.get_json(self.client.key("nodes", node))
            cause = loss_cause(node in now, registration if isinstance(registration, dict) else None, inc)
            record = self._last.get(node)     # its last value where the watch saw it deleted
            if record is None or incarnation_of(record) != inc:
                record = self.records.get(node, {})
            losses.append(Loss(node, inc, cause, record))
        self.known, self.records, self._last = now, records, {}
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

        The last closed round's number from ``rdzv/round`` (its closer's record), then the
        torchrun's rank key in that round; a record of the single-key handler names the
        participants itself. Without the record or the descriptor, from the node's last record
        (it ran workers).
        """
        current = self.client.get_json(round_key(self.client, self.job))
        if desc is None or not isinstance(current, dict):
            return loss.in_round
        if isinstance(current.get("participants"), list):        # the single-key handler's record
            return desc in current["participants"]
        round_ = current.get("round")
        if not isinstance(round_, int):
            return loss.in_round
        return self.client.get(rank_key(self.client, self.job, round_, desc))[0] is not None

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
    per report, reading back a count, the records created since, or (seldom) all of them
    (docs/perf.md, "A thousand nodes").

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


def _parse(raw: bytes) -> Any:
    """A record's JSON, or None for a value that is not (kept in the view: it counts)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None

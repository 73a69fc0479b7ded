"""The round keys of one rendezvous and every request on them (docs/design.md §2, "Rendezvous rounds").

Each round has its own keys, so no two torchruns write the same key
while a round forms and no write or watch event carries the whole group:

* a torchrun takes part in the forming round ``r`` by putting
  ``rounds/{r}/join/{desc}`` under its lease, in one transaction that
  deletes its key of the round it leaves and holds only while ``latest``
  still names round ``r - 1`` (so nobody joins a round that is closed);
* a torchrun that was not in round ``r - 1`` while that round is full
  (``max`` torchruns still in it) puts ``rounds/{r}/spare/{desc}``
  instead: torch's redundancy list, which asks nobody to restart;
* one joiner, the first to create ``rounds/{r}/closer`` under its lease,
  closes the round: it writes each participant's rank under
  ``rounds/{r}/rank/{desc}`` (transactions of ``MAX_TXN_OPS`` keys, held
  while it is the closer and ``latest`` is ``r - 1``), then one transaction
  writes ``rounds/{r}/closed`` (the world size and the closer, no names),
  moves ``latest`` to ``r`` and rewrites ``round`` for the agents;
* the others wait on a watch of ``rounds/{r}/close*`` (the closer and the
  closed keys, nothing that changes per joiner), then read their own rank
  key: a round of N costs each torchrun O(1) bytes, not the N names.

Reads ask for counts or key names where that is all they need, so a
check is a few bytes whatever the group's size. An etcd outage is
retried for ``grace`` seconds, then ``RendezvousConnectionError``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from marind.core import etcd_txn as tx
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import (
    close_watch_prefix,
    closed_key,
    closer_key,
    join_prefix,
    latest_key,
    lost_key,
    rank_key,
    rank_prefix,
    round_closed_key,
    round_key,
    round_prefix,
    spare_prefix,
)
from marind.rendezvous.retry import with_grace

T = TypeVar("T")
#: etcd's default limit on the operations of one transaction (``--max-txn-ops``)
MAX_TXN_OPS = 128


def parse_desc(desc: str) -> tuple[str, int, int]:
    """``"{addr}_{pid}_{local_id}"`` -> ``(addr, pid, local_id)`` (pure; torch's descriptor format).

    Raises:
        ValueError: not a descriptor.
    """
    addr, pid, local_id = desc.rsplit("_", 2)
    return addr, int(pid), int(local_id)


def rank_order(descs: Iterable[str]) -> list[str]:
    """The descriptors in rank order: torch's (``sorted`` of its ``_NodeDesc``: addr, pid, local id) (pure)."""
    return sorted(descs, key=parse_desc)


def choose(joined: list[tuple[str, int]], lost: frozenset[str], max_nodes: int) -> list[str]:
    """A round's participants in rank order: the first ``max_nodes`` to join, lost ones left out (pure).

    Args:
        joined: ``(desc, create_revision)`` of each joiner's key.
        lost: the descriptors the agents marked lost.
        max_nodes: the most participants a round takes.
    """
    alive = sorted((rev, desc) for desc, rev in joined if desc not in lost)
    return rank_order(desc for _, desc in alive[:max_nodes])


def close_due(*, now: float, prev_live: int, joined: int, min_nodes: int, max_nodes: int,
              deadline: float | None, last_call: float) -> tuple[bool, float | None]:
    """Does the forming round close now? ``(close, last-call deadline to keep)`` (pure).

    torch's rule, with the previous round's torchruns in place of its
    "participants of a complete round": the round does not close while one of
    them is still in that round (alive, not yet come over); then it closes at
    ``max_nodes`` joiners at once, or ``last_call`` seconds after it first had
    ``min_nodes`` (a drop below ``min_nodes`` clears that deadline, as torch does).
    """
    if prev_live > 0 or joined < min_nodes:
        return False, None
    if joined >= max_nodes:
        return True, deadline
    if deadline is None:
        deadline = now + last_call
    return now >= deadline, deadline


@dataclass(frozen=True)
class Place:
    """Where a torchrun has its key: round ``round``, as a joiner or (``spare``) waiting for a place."""

    round: int
    spare: bool = False


@dataclass(frozen=True)
class Look:
    """What a torchrun reads before it joins: the last closed round (-1: none) and what stops it."""

    latest: int
    closed: bool
    lost: bool
    #: torchruns still in round ``latest`` (None when that was not asked)
    prev_live: int | None


@dataclass(frozen=True)
class Closed:
    """A closed round: its number, size and the closer whose rank keys hold its ranks."""

    round: int
    world_size: int
    by: str


@dataclass(frozen=True)
class Check:
    """A waiting joiner's view of its round."""

    round_closed: Closed | None        # the round is closed (its rank keys name its participants)
    closer: bool                       # someone holds the closer key
    closed: bool                       # the rendezvous is closed
    lost: bool                         # this torchrun was marked lost
    prev_live: int = 0                 # closer only: torchruns still in the previous round
    joined: int = 0                    # closer only: joiners of this round


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"{what} holds no JSON (corrupt): {raw[:80]!r}") from exc


class Rounds:
    """Requests on one rendezvous' round keys (module doc).

    Args:
        client: the rendezvous' etcd client (its prefix applies).
        run_id: the rendezvous (job) id.
        grace: seconds an etcd outage is retried before RendezvousConnectionError.
    """

    def __init__(self, client: EtcdClient, run_id: str, grace: float) -> None:
        self.client, self.run_id, self.grace = client, run_id, grace
        self.closed_key = closed_key(client, run_id)
        self.latest_key = latest_key(client, run_id)

    # -- keys --------------------------------------------------------------------------------
    def key_of(self, desc: str, place: Place) -> str:
        """The key ``desc`` has at ``place``."""
        prefix = spare_prefix if place.spare else join_prefix
        return prefix(self.client, self.run_id, place.round) + desc

    def join_prefix(self, round_: int) -> str:
        return join_prefix(self.client, self.run_id, round_)

    def close_watch_prefix(self, round_: int) -> str:
        return close_watch_prefix(self.client, self.run_id, round_)

    def _latest_is(self, latest: int) -> Any:
        return tx.absent(self.latest_key) if latest < 0 else tx.equals(self.latest_key, str(latest))

    def run(self, fn: Callable[[], T], what: str, grace: float | None = None) -> T:
        """``fn()`` retried through an etcd outage; past the grace, RendezvousConnectionError."""
        grace = self.grace if grace is None else grace
        try:
            return with_grace(fn, grace, what)
        except ControlPlaneUnavailable as exc:
            raise RendezvousConnectionError(
                f"The rendezvous '{self.run_id}' cannot reach etcd at {self.client.endpoints_spec} for "
                f"{grace:g}s (--rdzv-conf etcd_grace_timeout): {exc}") from exc

    def _txn(self, what: str, compare: list, success: list, failure: list | None = None) -> Any:
        return self.run(lambda: self.client.txn(compare, success, failure), what)

    # -- joining -----------------------------------------------------------------------------
    def look(self, me: str, guess: int) -> Look:
        """The last closed round, whether the rendezvous is closed or ``me`` lost; with the count
        of torchruns in round ``guess`` (a torchrun's last round: usually still the last closed)."""
        ops = [tx.get(self.latest_key), tx.count(self.closed_key), tx.count(lost_key(self.client, self.run_id, me))]
        if guess >= 0:
            ops.append(tx.count(self.join_prefix(guess), prefix=True))
        resp = self._txn("rdzv look", [], ops)
        raw = tx.value_of(resp, 0)
        try:
            latest = int(raw) if raw is not None else -1
        except ValueError as exc:
            raise RendezvousStateError(f"{self.latest_key} holds {raw!r:.60}, not a round number") from exc
        prev_live = tx.count_of(resp, 3) if guess >= 0 and guess == latest else None
        if prev_live is None and latest >= 0:
            prev_live = self.count(self.join_prefix(latest))
        return Look(latest, tx.count_of(resp, 1) > 0, tx.count_of(resp, 2) > 0, prev_live)

    def count(self, prefix: str) -> int:
        """How many keys are under ``prefix`` (no key sent back)."""
        return tx.count_of(self._txn("rdzv count", [], [tx.count(prefix, prefix=True)]), 0)

    def join(self, me: str, lease_id: int, latest: int, place: Place, leave: Place | None) -> tuple[bool, bool, int]:
        """Put ``me`` at ``place`` (round ``latest + 1``) and drop its key at ``leave``, while
        ``latest`` is unchanged, the rendezvous open and ``me`` not marked lost.

        Returns:
            ``(written, the round has a closer, etcd's revision after the request)``.
        """
        key, value = self.key_of(me, place), json.dumps({"at": time.time()})   # this attempt's own value
        closer = tx.count(closer_key(self.client, self.run_id, place.round))
        ops = [tx.delete(self.key_of(me, leave))] if leave is not None and leave != place else []
        ops += [tx.put(key, value, lease_id), closer]
        compare = [self._latest_is(latest), tx.absent(self.closed_key),
                   tx.absent(lost_key(self.client, self.run_id, me))]
        # a request sent again (an outage, another member) may find its first send's write: its value
        resp = self._txn("rdzv join", compare, ops, [tx.get(key), closer])
        written = bool(resp.succeeded) or tx.value_of(resp, 0) == value.encode()
        has_closer = written and tx.count_of(resp, len(resp.responses) - 1) > 0
        return written, has_closer, int(resp.header.revision)

    def leave(self, me: str, place: Place | None, closer_round: int | None, grace: float) -> None:
        """Drop ``me``'s key at ``place`` and, when it still holds it, the closer key of ``closer_round``.

        One transaction (a nested one for the closer key, so that another closer's key stays),
        an outage retried for ``grace`` seconds.
        """
        ops = [tx.delete(self.key_of(me, place))] if place is not None else []
        if closer_round is not None:
            key = closer_key(self.client, self.run_id, closer_round)
            ops.append(tx.nested([tx.equals(key, me)], [tx.delete(key)]))
        if ops:
            self.run(lambda: self.client.txn([], ops), "rdzv leave", grace)

    # -- waiting and closing -----------------------------------------------------------------
    def claim_closer(self, me: str, round_: int, lease_id: int) -> bool:
        """Become the closer of ``round_`` (create only if absent, under this torchrun's lease)."""
        key = closer_key(self.client, self.run_id, round_)
        resp = self._txn("rdzv claim closer", [tx.absent(key), tx.absent(lost_key(self.client, self.run_id, me))],
                         [tx.put(key, me, lease_id)], [tx.get(key)])
        # a retried create that had landed on the first member finds our own descriptor there
        return bool(resp.succeeded) or tx.value_of(resp, 0) == me.encode()

    def check(self, me: str, round_: int, closer: bool) -> Check:
        """One read of what a joiner of ``round_`` waits for; a closer also gets the two counts."""
        ops = [tx.get(round_closed_key(self.client, self.run_id, round_)),
               tx.count(closer_key(self.client, self.run_id, round_)),
               tx.count(self.closed_key), tx.count(lost_key(self.client, self.run_id, me))]
        if closer:
            ops.append(tx.count(self.join_prefix(round_), prefix=True))
            if round_ > 0:
                ops.append(tx.count(self.join_prefix(round_ - 1), prefix=True))
        resp = self._txn("rdzv check", [], ops)
        raw = tx.value_of(resp, 0)
        round_closed = self.parse_closed(raw, round_) if raw is not None else None
        joined = tx.count_of(resp, 4) if closer else 0
        prev_live = tx.count_of(resp, 5) if closer and round_ > 0 else 0
        return Check(round_closed, tx.count_of(resp, 1) > 0, tx.count_of(resp, 2) > 0,
                     tx.count_of(resp, 3) > 0, prev_live, joined)

    def parse_closed(self, raw: bytes, round_: int) -> Closed:
        """What a ``rounds/{n}/closed`` value says: the round's size and closer."""
        where = round_closed_key(self.client, self.run_id, round_)
        value = _json(raw, where)
        size = value.get("world_size") if isinstance(value, dict) else None
        by = value.get("by") if isinstance(value, dict) else None
        if not isinstance(size, int) or size < 1 or not isinstance(by, str):
            raise RendezvousStateError(f"{where} names no world size and closer: {raw[:80]!r}")
        return Closed(round_, size, by)

    def seat(self, me: str, closed: Closed) -> int | None:
        """``me``'s rank in the closed round, or None when it is not a participant.

        One read of ``me``'s own rank key; a key left by an earlier closer that lost its claim
        (another ``by``) is not a seat.
        """
        where = rank_key(self.client, self.run_id, closed.round, me)
        raw = tx.value_of(self._txn("rdzv read rank", [], [tx.get(where)]), 0)
        if raw is None:
            return None
        value = _json(raw, where)
        rank = value.get("rank") if isinstance(value, dict) else None
        if not isinstance(rank, int) or not 0 <= rank < closed.world_size:
            raise RendezvousStateError(f"{where} holds no rank below {closed.world_size}: {raw[:80]!r}")
        return rank if value.get("by") == closed.by else None

    def members(self, round_: int) -> list[str]:
        """The participants of closed round ``round_`` (their rank keys' names; empty once cleaned up)."""
        prefix = rank_prefix(self.client, self.run_id, round_)
        return [key[len(prefix):] for key, _ in tx.keys_of(self._txn("rdzv read members", [], [tx.keys(prefix)]), 0)]

    def joiners(self, round_: int) -> list[tuple[str, int]]:
        """``(desc, create_revision)`` of every joiner of ``round_`` (key names only)."""
        prefix = self.join_prefix(round_)
        return [(key[len(prefix):], rev)
                for key, rev in tx.keys_of(self._txn("rdzv joiners", [], [tx.keys(prefix)]), 0)]

    def close(self, round_: int, participants: list[str], by: str) -> Closed | None:
        """Close ``round_`` with ``participants`` (rank order) unless it was closed first.

        First what an earlier closer of the round left is dropped, then the rank keys are
        written, ``MAX_TXN_OPS`` a transaction, each of these held while ``by`` holds the closer key and ``latest``
        is ``round_ - 1``; then one transaction, held while that is still so and ``by`` is not
        marked lost: the closed key, ``latest``, the agents' ``round`` record, and the keys of
        round ``round_ - 2`` dropped. Nobody reads a rank key before the closed key exists.

        Returns:
            The round as closed (by us, or by the closer that won); None when it is not closed
            (``by`` lost the closer key or was marked lost: it looks again) or ``latest`` moved
            past it and its keys were cleaned up (a stale closer).
        """
        held = [self._latest_is(round_ - 1), tx.equals(closer_key(self.client, self.run_id, round_), by)]
        ranks = rank_prefix(self.client, self.run_id, round_)
        batches = [[tx.delete_prefix(ranks)]]    # etcd takes no put inside a range the same request deletes
        batches += [[tx.put(ranks + desc, json.dumps({"rank": start + i, "by": by}))
                     for i, desc in enumerate(participants[start:start + MAX_TXN_OPS])]
                    for start in range(0, len(participants), MAX_TXN_OPS)]
        for ops in batches:
            if not self._txn("rdzv write ranks", held, ops).succeeded:
                return self._closed_as(round_)
        value = json.dumps({"round": round_, "world_size": len(participants), "at": time.time(), "by": by})
        ops = [tx.put(round_closed_key(self.client, self.run_id, round_), value),
               tx.put(self.latest_key, str(round_)), tx.put(round_key(self.client, self.run_id), value)]
        if round_ >= 2:
            ops.append(tx.delete_prefix(round_prefix(self.client, self.run_id, round_ - 2)))
        resp = self._txn("rdzv close", [*held, tx.absent(lost_key(self.client, self.run_id, by))],
                         ops, [tx.get(round_closed_key(self.client, self.run_id, round_))])
        if resp.succeeded:
            return Closed(round_, len(participants), by)
        raw = tx.value_of(resp, 0)
        return None if raw is None else self.parse_closed(raw, round_)

    def _closed_as(self, round_: int) -> Closed | None:
        raw = tx.value_of(self._txn("rdzv read round", [], [tx.get(round_closed_key(self.client, self.run_id, round_))]), 0)
        return None if raw is None else self.parse_closed(raw, round_)

    # -- the rendezvous as a whole ------------------------------------------------------------
    def waiting(self, round_: int) -> int:
        """How many torchruns joined the round after ``round_`` (torch's wait list)."""
        return self.count(self.join_prefix(round_ + 1))

    def set_closed(self, by: str, grace: float) -> bool:
        """Close the rendezvous (idempotent), retrying an outage for ``grace`` seconds.

        Returns:
            False, closing nothing, when ``by`` is marked lost: a torchrun the agents declared
            lost exits through torchrun's ``shutdown``, which must not end its survivors' job.
        """
        value = json.dumps({"by": by, "at": time.time()})       # the first to close it stays named
        close = tx.nested([tx.absent(self.closed_key)], [tx.put(self.closed_key, value)])
        resp = self.run(lambda: self.client.txn([tx.absent(lost_key(self.client, self.run_id, by))], [close]),
                        "rdzv set_closed", grace)
        return bool(resp.succeeded)

    def is_closed(self) -> bool:
        return tx.count_of(self._txn("rdzv is_closed", [], [tx.count(self.closed_key)]), 0) > 0

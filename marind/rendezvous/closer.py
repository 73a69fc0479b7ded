"""Waiting for a round without polling it, and closing it from one torchrun.

``Wakeup`` turns etcd watches into one event a waiting torchrun sleeps on:
a joiner watches only its round's ``closer`` and ``closed`` keys, so N
joiners cost etcd N watches and about N events per round, not N reads a
second; the event that closes the round carries its size and closer (a few
bytes), and a joiner then reads its own rank key. A broken watch (etcd restarted) only makes the
waiter fall back to its periodic check, which also sees the rendezvous
closed or this torchrun marked lost.

``Closer`` is the closing side of one forming round, held by the torchrun
whose create of ``rounds/{r}/closer`` succeeded. It decides on counts (a
few bytes each, whatever the group's size) and reads the joiners' names
once, when it closes. It applies the agents' lost markers: their keys are
dropped from the previous and the forming round (the previous round then
stops holding the new one back), they are left out of the participants, and
a round re-forming after a loss closes as soon as every survivor of the
previous round joined (``lost.complete_early``) instead of waiting out
``last_call_timeout``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from marind.core import etcd_txn as tx
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.rendezvous.lost import LostNodes, complete_early
from marind.rendezvous.rounds import MAX_TXN_OPS, Check, Closed, Place, Rounds, choose, close_due

log = get_logger(__name__)


class Wakeup:
    """One event set by the watch events a waiting torchrun cares about.

    Args:
        client: the rendezvous' etcd client.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._event = threading.Event()
        self._ids: list[int] = []
        self._specs: list[tuple[str, Callable[[Any], bool]]] = []
        #: a watch failed or broke: the waiter must not count on being woken (``repair``)
        self.broken = False
        #: the value of the last ``.../closed`` key a watch saw written (the round is closed)
        self.closed_value: bytes | None = None

    def watch(self, prefix: str, start_revision: int | None, wanted: Callable[[Any], bool]) -> None:
        """Wake on events under ``prefix`` (from ``start_revision``) for which ``wanted(event)`` holds."""
        self._specs.append((prefix, wanted))
        self._add(prefix, start_revision, wanted)

    def repair(self) -> None:
        """Watch again from now after a watch broke (the caller reads its round next, so no
        change in between is missed); still ``broken`` when etcd is still away."""
        self.close()
        self.broken = False
        for prefix, wanted in self._specs:
            self._add(prefix, None, wanted)

    def _add(self, prefix: str, start_revision: int | None, wanted: Callable[[Any], bool]) -> None:
        def on_response(response: Any) -> None:
            events = getattr(response, "events", None)
            if events is None:                  # the stream broke: the library passes the error
                self.broken = True
                self._event.set()
                return
            for event in events:
                if type(event).__name__ == "PutEvent" and event.key.endswith(b"/closed"):
                    self.closed_value = event.value
            if any(wanted(event) for event in events):
                self._event.set()
        try:
            self._ids.append(self._client.watch_prefix(prefix, on_response, start_revision))
        except Exception as exc:  # noqa: BLE001 - without a watch the waiter polls
            self.broken = True
            log.warning("rdzv_watch_failed", prefix=prefix, error=f"{type(exc).__name__}: {exc}")

    def wait(self, timeout: float) -> bool:
        """Sleep until woken or ``timeout`` seconds passed; whether it was woken."""
        woken = self._event.wait(max(0.0, timeout))
        self._event.clear()
        return woken

    def close(self) -> None:
        """Cancel the watches."""
        for watch_id in self._ids:
            self._client.cancel_watch(watch_id)
        self._ids = []


class Closer:
    """Closes forming round ``round_`` once torch's conditions hold (``rounds.close_due``).

    Args:
        rounds: the rendezvous' round keys.
        lost: the agents' lost markers.
        me: this torchrun's descriptor.
        round_: the forming round.
        min_nodes, max_nodes: the round's bounds.
        last_call: seconds the round stays open once ``min_nodes`` joined.
    """

    def __init__(self, rounds: Rounds, lost: LostNodes, me: str, round_: int, min_nodes: int,
                 max_nodes: int, last_call: float) -> None:
        self._rounds, self._lost, self.me, self.round = rounds, lost, me, round_
        self._min, self._max, self._last_call = min_nodes, max_nodes, last_call
        self.deadline: float | None = None
        self._purged: set[str] = set()
        self._prev: frozenset[str] | None = None
        self._early_checked_at = -1
        #: a close was refused with the round still open (the claim lapsed, or this torchrun was
        #: marked lost): this is no longer the round's closer
        self.abandoned = False

    def step(self, check: Check) -> Closed | None:
        """Look at the round (``check``'s counts): close it when due.

        Returns:
            The round once it is closed (by this call, or by another closer first), else None.
        """
        lost = self._lost.descs()
        if lost - self._purged:
            self._purge(lost - self._purged)
            self._purged |= lost
            return None                          # the counts moved: look again
        due, self.deadline = close_due(now=time.monotonic(), prev_live=check.prev_live, joined=check.joined,
                                       min_nodes=self._min, max_nodes=self._max, deadline=self.deadline,
                                       last_call=self._last_call)
        early = not due and self.deadline is not None and self._survivors_in(check.joined, lost)
        if not (due or early):
            return None
        chosen = choose(self._rounds.joiners(self.round), lost, self._max)
        if len(chosen) < self._min:              # some left since the count: wait for more
            return None
        closed = self._rounds.close(self.round, chosen, self.me)
        if closed is None:
            self.abandoned = True
            log.info("rdzv_close_refused", run_id=self._rounds.run_id, round=self.round, node=self.me)
            return None
        log.info("rdzv_round_closed", run_id=self._rounds.run_id, round=self.round, world_size=closed.world_size,
                 early=early, ours=closed.by == self.me)
        return closed

    def _purge(self, descs: frozenset[str]) -> None:
        """Drop the keys the lost torchruns still hold in the previous and the forming round.

        Reads first which of those keys exist (counts: nothing is written for a marker of
        an earlier round), then deletes only those.
        """
        keys = [self._rounds.key_of(d, Place(r)) for d in sorted(descs)
                for r in (self.round - 1, self.round) if r >= 0]
        present: list[str] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start:start + MAX_TXN_OPS]
            resp = self._send("rdzv lost keys", [tx.count(k) for k in chunk])
            present += [k for i, k in enumerate(chunk) if tx.count_of(resp, i) > 0]
        for start in range(0, len(present), MAX_TXN_OPS):
            self._send("rdzv drop lost", [tx.delete(k) for k in present[start:start + MAX_TXN_OPS]])
        if present:
            log.info("rdzv_drop_lost_nodes", run_id=self._rounds.run_id, round=self.round, keys=len(present))

    def _send(self, what: str, ops: list) -> Any:
        client = self._rounds.client
        return self._rounds.run(lambda: client.txn([], ops), what)

    def _survivors_in(self, joined: int, lost: frozenset[str]) -> bool:
        """After a loss: has every survivor of the previous round joined this one?"""
        if not lost or self.round == 0:
            return False
        if self._prev is None:
            self._prev = frozenset(self._rounds.members(self.round - 1))
        survivors = self._prev - lost
        if not (self._prev & lost) or joined < len(survivors) or joined == self._early_checked_at:
            return False
        self._early_checked_at = joined           # one read of the names per new count
        present = frozenset(desc for desc, _ in self._rounds.joiners(self.round))
        return complete_early(last_world=self._prev, lost=lost, participants=present,
                              complete=False, deadline_set=True)

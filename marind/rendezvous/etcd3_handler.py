"""``Etcd3RendezvousHandler``: torch's rendezvous contract on per-round etcd keys.

torch's dynamic rendezvous keeps every participant in one state value
that each node rewrites by compare-and-swap: N joiners contend for one key
and every write carries the whole group, so a round costs etcd O(N²) bytes
and retries (docs/perf.md, "Rendezvous"). Here each torchrun writes its
own key and one closer writes the result once (``marind.rendezvous.rounds``);
a round costs O(N) requests and bytes written.

What torchrun's elastic agent sees is torch's ``RendezvousHandler``:

* ``next_rendezvous``: leave the current round and join the forming one
  (or wait as a spare while the current one is full), wait until it is
  closed, and return this node's rank, the world size, the round's store
  (``PrefixStore("torch.rendezvous.{run_id}.{round}", Etcd3Store)``) and the
  workers' bootstrap store: rank 0 starts a fresh TCPStore in every round
  (torch would reuse its first one, which breaks after rank 0 changes or is
  lost) unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
* ``num_nodes_waiting``: how many torchruns joined the round after this
  node's (a count, read again only after a join there: ``waiting``), which
  makes the agent restart its workers into a larger round;
* ``set_closed``/``is_closed``/``shutdown``: the rendezvous' ``closed`` key;
  a closed rendezvous admits nobody: a spare leaves with
  ``RendezvousGracefulExitError``, anyone else gets ``RendezvousClosedError``;
* liveness: every key a torchrun writes lives under its own lease of
  ``keep_alive_interval x keep_alive_max_attempt`` seconds, renewed every
  ``keep_alive_interval`` by the ``RendezvousKeepAliveTimer_{id}`` thread; a
  node that dies leaves its rounds when its lease expires, and one the agents
  mark lost (``rdzv/lost/``) at once (``closer.Closer``); a torchrun marked lost
  can no longer join (``RendezvousClosedError``).
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, _NodeDescGenerator
from torch.distributed.elastic.rendezvous.utils import _delay, _PeriodicTimer

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.rendezvous.closer import Closer, Wakeup
from marind.rendezvous.lost import LostNodes
from marind.rendezvous.rounds import Closed, Place, Rounds
from marind.rendezvous.store import Etcd3Store
from marind.rendezvous.waiting import WaitingCount

log = get_logger(__name__)

#: seconds between a spare's looks at the full round (torch syncs a waiting node every second)
SPARE_POLL_S = 1.0
#: seconds between a closer's looks at its round when no join woke it (deadlines, expired leases)
CLOSER_TICK_S = 0.5
#: seconds a joiner waits on its watches before it reads its round anyway (a broken watch)
WAITER_CHECK_S = 5.0
#: seconds between a joiner's reads of its round while its watch is broken
BROKEN_CHECK_S = 1.0
#: seconds a joiner stays asleep after a wake-up, so that a burst of joins is one look
COALESCE_S = 0.05
#: seconds leaving a round is retried (the lease expiry removes the key anyway)
LEAVE_GRACE_S = 2.0


class Etcd3RendezvousHandler(RendezvousHandler):
    """torchrun's rendezvous on etcd v3, per-round keys (module doc).

    Args:
        client: the etcd client (its prefix applies).
        store: the agents' c10d store on etcd.
        settings: torch's settings: run id, min and max nodes, timeouts, keep-alive.
        local_addr: this node's address (``--local-addr``), else its FQDN.
        grace: seconds an etcd outage is retried before RendezvousConnectionError.

    Raises:
        ValueError: an empty run id, ``min_nodes < 1``, ``max_nodes < min_nodes``, or an
            address with ``/`` (it is part of an etcd key).
    """

    _node_desc_generator = _NodeDescGenerator()     # torch's: the same descriptors as its handler

    def __init__(self, client: EtcdClient, store: Etcd3Store, settings: RendezvousSettings,
                 local_addr: str | None = None, grace: float = 30.0) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if settings.min_nodes < 1:
            raise ValueError(f"The minimum number of nodes ({settings.min_nodes}) must be greater than zero.")
        if settings.max_nodes < settings.min_nodes:
            raise ValueError(f"The maximum number of nodes ({settings.max_nodes}) must be greater than or equal "
                             f"to the minimum number of nodes ({settings.min_nodes}).")
        self._this_node = self._node_desc_generator.generate(local_addr)
        self._desc = repr(self._this_node)
        if "/" in self._desc:
            raise ValueError(f"the rendezvous address {self._this_node.addr!r} may not contain '/'")
        self._settings, self._client, self._store, self._grace = settings, client, store, grace
        self._rounds = Rounds(client, settings.run_id, grace)
        self._lease: Any = None
        self._lease_lost = False
        self._keep_alive_timer: _PeriodicTimer | None = None
        self._place: Place | None = None            # where this torchrun's key is
        self._closer_round: int | None = None       # the round whose closer key it holds
        self._round: int | None = None              # the round it takes part in (after next_rendezvous)
        self._latest = -1                           # the last closed round it saw
        self._first_join = True
        self._lost: LostNodes | None = None
        self._waiting = WaitingCount(client, self._rounds.join_prefix, self._rounds.count)
        self._shared_tcp_store_server: dist.Store | None = None
        self._bootstrap_store_info: RendezvousStoreInfo | None = None

    # -- torch's RendezvousHandler -------------------------------------------------------------
    @property
    def settings(self) -> RendezvousSettings:
        """torch's settings of this rendezvous."""
        return self._settings

    def get_backend(self) -> str:
        """``"etcd3"``."""
        return "etcd3"

    def get_run_id(self) -> str:
        """The rendezvous (job) id."""
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        """torch's rule: the workers share the agents' store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; block until it is closed with this node in it (module doc).

        Raises:
            RendezvousClosedError: the rendezvous is closed, or the agents marked this torchrun lost.
            RendezvousGracefulExitError: the rendezvous closed while this node waited as a spare.
            RendezvousTimeoutError: no round took this node within ``join_timeout``.
            RendezvousConnectionError: etcd unreachable for longer than the grace.
            RendezvousStateError: a round key holds something unreadable.
        """
        log.info("rdzv_join", run_id=self.get_run_id(), node=self._desc, last_round=self._round)
        if self._first_join:      # torch's skew of the first attempt: spreads a fleet's start
            self._first_join = False
            _delay(seconds=(0, 0.3))
        self._ensure_lease()
        try:
            round_, rank, world_size = self._take_part()
        except BaseException:
            self._stop_heartbeats()      # as torch's handler: no keep-alive without a round (the lease lapses)
            raise
        self._round = round_
        self._waiting.forget()
        store = dist.PrefixStore(f"torch.rendezvous.{self.get_run_id()}.{round_}", self._store)
        info = self._bootstrap(rank, store)
        if rank == 0 and round_ >= 2:
            try:
                self._store.delete_rounds_before(round_ - 1)
            except ControlPlaneUnavailable as exc:    # housekeeping only: never fail a round on it
                log.warning("rdzv_store_cleanup_failed", run_id=self.get_run_id(), error=str(exc))
        log.info("rdzv_joined", run_id=self.get_run_id(), node=self._desc, round=round_, rank=rank,
                 world_size=world_size, master_addr=info.master_addr, master_port=info.master_port)
        return RendezvousInfo(store, rank, world_size, info)

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (eventually consistent, as torch's)."""
        return self._rounds.is_closed()

    def set_closed(self) -> None:
        """Close the rendezvous, retrying an outage for at most ``close_timeout`` (or the grace).

        Raises:
            RendezvousClosedError: this torchrun was marked lost: it may not close its survivors'
                rendezvous (torchrun's ``shutdown`` on its way out then returns False).
            RendezvousConnectionError: etcd unreachable for that long.
        """
        grace = min(self._grace, self._settings.timeout.close.total_seconds())
        if not self._rounds.set_closed(self._desc, grace):
            raise RendezvousClosedError(
                f"the agents declared this node ({self._desc}) lost; it may not close the rendezvous")

    def num_nodes_waiting(self) -> int:
        """How many torchruns joined the round after this node's (0 before its first round)."""
        if self._round is None:
            return 0
        return self._waiting.get(self._round)     # counted after a join there (a watch), not per call

    def shutdown(self) -> bool:
        """Close the rendezvous and let go of this torchrun's keys; False when it could not close it."""
        self._stop_heartbeats()
        try:
            self.set_closed()
            closed = True
        except RendezvousError as exc:
            log.warning("rdzv_shutdown_failed", run_id=self.get_run_id(), error=f"{type(exc).__name__}: {exc}")
            closed = False
        self._release()
        return closed

    # -- taking part in a round -----------------------------------------------------------------
    def _take_part(self) -> tuple[int, int, int]:
        """Join (or wait as a spare for) the forming round until one closes with this node in it:
        ``(round, rank, world size)``."""
        me, settings = self._desc, self._settings
        deadline = time.monotonic() + settings.timeout.join.total_seconds()
        while True:
            if self._lease_lost:
                self._place = self._closer_round = None          # its keys went with the lease
                self._ensure_lease()
            look = self._rounds.look(me, self._latest)
            self._latest = look.latest
            if look.closed or look.lost:
                spare = self._place is not None and self._place.spare
                self._leave()
                if look.lost:
                    raise RendezvousClosedError(
                        f"the agents declared this node ({me}) lost; it must not rejoin with this torchrun "
                        "(its agent starts a new one)")
                if spare:
                    raise RendezvousGracefulExitError(
                        f"The rendezvous '{settings.run_id}' is closed, terminating pending rendezvous.")
                raise RendezvousClosedError(f"The rendezvous '{settings.run_id}' is closed.")
            forming = look.latest + 1
            # torch's redundancy list: the last round is full without this node (its own key there,
            # as a participant leaving it or one that came late, does not count)
            others = (look.prev_live or 0) - (self._place == Place(look.latest))
            if look.latest >= 0 and others >= settings.max_nodes:
                self._wait_as_spare(look.latest)
                continue
            if self._place is not None and self._place.spare:
                deadline = time.monotonic() + settings.timeout.join.total_seconds()   # torch's update_deadline
            if time.monotonic() > deadline:
                self._leave()
                raise RendezvousTimeoutError(
                    f"round {forming} of the rendezvous '{settings.run_id}' did not close within "
                    f"{settings.timeout.join.total_seconds():g}s (join_timeout)")
            written, has_closer, revision = self._rounds.join(me, self._lease.id, look.latest, Place(forming),
                                                              self._place)
            if not written:
                continue                                 # a round closed meanwhile: look again
            self._place = Place(forming)
            seat = self._wait_round(forming, has_closer, revision, deadline)
            if seat is not None:
                return forming, *seat

    def _wait_as_spare(self, latest: int) -> None:
        """Hold a spare key for round ``latest + 1`` until round ``latest`` has room or moved on."""
        place = Place(latest + 1, spare=True)
        if self._place != place:
            written, _, _ = self._rounds.join(self._desc, self._lease.id, latest, place, self._place)
            if not written:
                return
            self._place = place
            log.info("rdzv_spare", run_id=self.get_run_id(), node=self._desc, round=place.round)
        time.sleep(SPARE_POLL_S)

    def _wait_round(self, round_: int, has_closer: bool, revision: int, deadline: float) -> tuple[int, int] | None:
        """Wait as a joiner of ``round_`` until it closes.

        Returns:
            ``(rank, world size)`` when this node is a participant; None when the round closed
            without this node, or this node's lease expired (the caller joins again).
        """
        me = self._desc
        wake = Wakeup(self._client)
        closer: Closer | None = None
        try:
            # from just after the join: the join's answer is the state until then
            wake.watch(self._rounds.close_watch_prefix(round_), revision + 1,
                       lambda ev: (ev.key.endswith(b"/closed") or type(ev).__name__ == "DeleteEvent"))
            if not has_closer:
                closer = self._try_closer(round_, wake)
            look = closer is not None or wake.broken
            while True:
                check = None
                closed: Closed | None = None
                if wake.closed_value is not None:
                    closed = self._rounds.parse_closed(wake.closed_value, round_)
                elif look:
                    check = self._rounds.check(me, round_, closer is not None)
                    closed = check.round_closed
                    if closed is None and closer is not None:
                        closed = closer.step(check)
                        if closer.abandoned:             # the close was refused: no longer its closer
                            closer = None                # (_leave still drops the key if it names us)
                look = True
                if closed is not None:
                    self._closer_round = None            # the round is closed: nothing left to close
                    rank = self._rounds.seat(me, closed)
                    if rank is not None:
                        return rank, closed.world_size
                    log.info("rdzv_late", run_id=self.get_run_id(), node=me, round=round_)
                    return None                          # the caller joins the next round
                if self._lease_lost or (check is not None and (check.closed or check.lost)):
                    return None                          # the caller reads why, and leaves or rejoins
                if closer is None and check is not None and not check.closer:
                    closer = self._try_closer(round_, wake)
                now = time.monotonic()
                if now > deadline:
                    self._leave()
                    raise RendezvousTimeoutError(
                        f"round {round_} of the rendezvous '{self.get_run_id()}' did not close within "
                        f"{self._settings.timeout.join.total_seconds():g}s (join_timeout)")
                pause = CLOSER_TICK_S if closer is not None else WAITER_CHECK_S
                if wake.broken:                          # etcd restarted or a member went: watch anew
                    wake.repair()
                    pause = min(pause, BROKEN_CHECK_S)
                if closer is not None and closer.deadline is not None:
                    pause = min(pause, max(0.0, closer.deadline - now) + 0.01)
                if wake.wait(min(pause, max(0.0, deadline - now) + 0.01)):
                    time.sleep(COALESCE_S)
        finally:
            wake.close()

    def _try_closer(self, round_: int, wake: Wakeup) -> Closer | None:
        """Try to become ``round_``'s closer; the closer also wakes on every join."""
        if not self._rounds.claim_closer(self._desc, round_, self._lease.id):
            return None
        self._closer_round = round_
        if self._lost is None:
            self._lost = LostNodes(self._client, self.get_run_id())
        wake.watch(self._rounds.join_prefix(round_), None, lambda ev: True)
        log.info("rdzv_closer", run_id=self.get_run_id(), node=self._desc, round=round_)
        timeout = self._settings.timeout
        return Closer(self._rounds, self._lost, self._desc, round_, self._settings.min_nodes,
                      self._settings.max_nodes, timeout.last_call.total_seconds())

    def _leave(self) -> None:
        """Drop this torchrun's key and closer key (best effort: they expire with the lease anyway)."""
        place, closer_round = self._place, self._closer_round
        self._place = self._closer_round = None
        try:
            self._rounds.leave(self._desc, place, closer_round, LEAVE_GRACE_S)
        except RendezvousConnectionError as exc:
            log.warning("rdzv_leave_failed", run_id=self.get_run_id(), error=str(exc))

    # -- the workers' bootstrap store -----------------------------------------------------------
    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return dist.TCPStore(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True)

    def _bootstrap(self, rank: int, store: dist.Store) -> RendezvousStoreInfo:
        """The workers' store address: rank 0 publishes it in the round's store, the others read it.

        A new server every round, where torch 2.13 keeps its first round's while a node stays
        rank 0: otherwise a node joining a later round waits for an address rank 0 never writes
        into that round's store, the survivors of a lost rank 0 keep its address, and the next
        generation of workers meets the previous one's keys in the old server (gloo then dials
        dead peers). torch's worker side expects a new TCPStore for every retry.
        """
        addr = self._this_node.addr
        if not self.use_agent_store:
            self._bootstrap_store_info = RendezvousStoreInfo.build(rank, store, local_addr=addr)
            return self._bootstrap_store_info
        port = 0
        self._shared_tcp_store_server = None        # the previous round's server goes (its workers did)
        if rank == 0:
            self._shared_tcp_store_server = self._create_tcp_store_server(addr, 0)
            port = self._shared_tcp_store_server.port
        self._bootstrap_store_info = RendezvousStoreInfo.build(rank, store, local_addr=addr, server_port=port)
        return self._bootstrap_store_info

    # -- the lease -------------------------------------------------------------------------------
    def _ensure_lease(self) -> None:
        """A live lease for this torchrun's keys, and the thread that keeps it alive (a new lease
        when the thread was stopped: the old one may have lapsed since)."""
        if self._lease is None or self._lease_lost or self._keep_alive_timer is None:
            ttl = max(1, round(self._settings.keep_alive_interval.total_seconds()
                               * self._settings.keep_alive_max_attempt))
            self._lease = self._rounds.run(lambda: self._client.lease(ttl), "rdzv lease")
            self._lease_lost = False
        if self._keep_alive_timer is None:
            timer = _PeriodicTimer(self._settings.keep_alive_interval, self._keep_alive_weak, weakref.ref(self))
            timer.set_name(f"RendezvousKeepAliveTimer_{self._this_node.local_id}")
            timer.start()
            self._keep_alive_timer = timer

    @staticmethod
    def _keep_alive_weak(weak_self: weakref.ref) -> None:
        self = weak_self()
        if self is not None:
            self._keep_alive()

    def _keep_alive(self) -> None:
        """Renew the lease once; a failure is logged (the next interval tries again)."""
        lease = self._lease
        if lease is None:
            return
        try:
            ttl = self._client.refresh_lease(lease)
        except ControlPlaneUnavailable as exc:
            log.warning("rdzv_keep_alive_failed", run_id=self.get_run_id(), node=self._desc, error=str(exc))
            return
        if ttl <= 0 and lease is self._lease:
            self._lease_lost = True
            log.warning("rdzv_lease_expired", run_id=self.get_run_id(), node=self._desc, round=self._round)

    def _stop_heartbeats(self) -> None:
        """Stop the keep-alive thread (the keys then expire with the lease)."""
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None

    def _release(self) -> None:
        """Revoke the lease (this torchrun's keys go with it) and stop the lost-marker watch."""
        lease, self._lease = self._lease, None
        self._place = self._closer_round = None
        if lease is not None:
            try:
                self._client.revoke_lease(lease)
            except ControlPlaneUnavailable as exc:
                log.warning("rdzv_lease_revoke_failed", run_id=self.get_run_id(), error=str(exc))
        if self._lost is not None:
            self._lost.close()
            self._lost = None
        self._waiting.close()


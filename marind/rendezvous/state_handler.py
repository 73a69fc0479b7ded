"""The earlier etcd3 rendezvous: torch's ``DynamicRendezvousHandler`` on one state key.

torchrun's ``--rdzv-backend=etcd3`` no longer builds this (it builds
``marind.rendezvous.etcd3_handler.Etcd3RendezvousHandler``, per-round
keys). It stays as the comparison the rendezvous bench and the counted
requests test measure the new one against (``bench/rendezvous_bench.py
--backends etcd3-state``): every node rewrites the whole state, one key
(``{p}/jobs/{run_id}/rdzv/state``, ``Etcd3RendezvousBackend``), by
compare-and-swap, so a round's etcd work grows with the square of the
nodes. It applies the agents' lost markers through ``LossAwareStateHolder``
(``marind.rendezvous.lost``). Its options are the etcd3 handler's
(``marind.rendezvous.handler``).

``frame_method_name`` also lives here: torch's own handlers (this one and
c10d's in the bench) name every event they record with ``inspect.stack()``.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
)

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.rendezvous.backend import Etcd3RendezvousBackend
from marind.rendezvous.handler import _positive, _timeouts, connect, parse_options
from marind.rendezvous.lost import LossAwareStateHolder, LostNodes
from marind.rendezvous.store import Etcd3Store

log = get_logger(__name__)


class Etcd3StateRendezvousHandler(DynamicRendezvousHandler):
    """torch's handler, with a fresh workers' store every round.

    torch 2.13 builds the bootstrap info (``MASTER_ADDR``/``MASTER_PORT``
    of the workers' TCPStore, hosted by the rank-0 agent) in a node's
    first round only and reuses it, and the store server with it, while
    the node stays rank 0. Three things break on that: a node joining a
    later round (scale-up, a replacement) waits for a key rank 0 never
    writes into that round; after the rank-0 node is lost, the other
    survivors keep the dead node's address; and the next generation of
    workers meets the previous one's keys in the reused server (gloo then
    dials dead peers: "Connection refused"). torch's worker side assumes
    "a new TCPStore for every retry"; this handler makes that true: rank 0
    starts a new server and publishes it in every round, the others read
    the current round. Rank 0 also drops the etcd store keys of rounds
    older than the previous one.

    Its state holder applies the agents' lost markers (``marind.rendezvous.lost``):
    a node the agents declared lost leaves the state at once, and a round
    re-forming after a loss completes as soon as the survivors are in.

    Made by ``create_state_handler`` (through torch's ``from_backend``); its public
    methods are torch's ``RendezvousHandler`` API (``next_rendezvous``,
    ``is_closed``, ``set_closed``, ``num_nodes_waiting``, ``shutdown``, ...).
    """

    @classmethod
    def with_lost_nodes(cls, run_id: str, store: Etcd3Store, backend: Etcd3RendezvousBackend,
                        client: EtcdClient, min_nodes: int, max_nodes: int, local_addr: str | None,
                        timeout: RendezvousTimeout, keep_alive_interval: int,
                        keep_alive_max_attempt: int) -> Etcd3StateRendezvousHandler:
        """torch's ``from_backend``, with a ``LossAwareStateHolder`` (same arguments, plus the client)."""
        node = cls._node_desc_generator.generate(local_addr)
        settings = RendezvousSettings(run_id, min_nodes, max_nodes, timeout,
                                      keep_alive_interval=timedelta(seconds=keep_alive_interval),
                                      keep_alive_max_attempt=keep_alive_max_attempt)
        holder = LossAwareStateHolder(backend, settings, LostNodes(client, run_id), repr(node))
        return cls(node, settings, backend.name, store, holder)

    def _get_world(self) -> tuple[int, int]:
        rank, world_size = super()._get_world()
        holder = self._state_holder
        if isinstance(holder, LossAwareStateHolder):
            holder.world_formed(rank)
        # torch rebuilds both (a new server on rank 0) when the cached info is None
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        round_ = self._state_holder.state.round
        if rank == 0 and isinstance(self._store, Etcd3Store) and round_ >= 2:
            try:
                self._store.delete_rounds_before(round_ - 1)
            except ControlPlaneUnavailable as exc:  # housekeeping only: never fail a round on it
                log.warning("rdzv_store_cleanup_failed", run_id=self._settings.run_id, error=str(exc))
        return rank, world_size


def frame_method_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name(depth)`` returns, read off the frame.

    torch names every rendezvous event it records (each join attempt,
    keep-alive and sync) with two full ``inspect.stack()`` calls, which
    read source lines for every frame and scan ``sys.modules``: a large
    CPU cost per event at a deep stack, paid by the torchrun agent while
    its node's workers want the cores, and the reason many simulated
    agents on a small machine never finished a round (figures:
    docs/perf.md, "Rendezvous").

    Args:
        depth: frames up from this function (2: the caller's caller, as torch's default).

    Returns:
        That frame's function name, or ``"no_method_name"`` past the top of the stack.
    """
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def use_frame_method_names() -> None:
    """Make torch's rendezvous name its events with ``frame_method_name`` (same names).

    Replaces ``dynamic_rendezvous.get_method_name`` for the whole process (idempotent);
    a torch without that function is left alone.
    """
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = frame_method_name


def create_state_handler(params: RendezvousParameters) -> Etcd3StateRendezvousHandler:
    """The earlier etcd3 handler for ``params`` (same options as ``handler.create_handler``).

    Raises:
        ValueError: a bad option.
        RendezvousConnectionError: etcd cannot be reached with these settings.
    """
    options = parse_options(params)
    use_frame_method_names()
    client = connect(options, params.run_id)
    backend = Etcd3RendezvousBackend(client, params.run_id, grace=options.grace_timeout)
    store = Etcd3Store(client, params.run_id, timeout=timedelta(seconds=options.store_timeout),
                       grace=options.grace_timeout)
    return Etcd3StateRendezvousHandler.with_lost_nodes(
        params.run_id, store, backend, client, params.min_nodes, params.max_nodes, params.local_addr,
        _timeouts(params), _positive(params, "keep_alive_interval", 5),
        _positive(params, "keep_alive_max_attempt", 3))

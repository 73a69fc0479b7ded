"""``create_handler``: what ``torchrun --rdzv-backend=etcd3`` ends up calling.

Options come from ``--rdzv-conf key=value,...`` (``params.config``):

=====================  ===============================================================
prefix                 etcd key prefix (default ``/marind``)
read_timeout           seconds per etcd request (default 10)
store_timeout          seconds an agent waits on a store key (default 60, as c10d)
etcd_grace_timeout     seconds an etcd outage is retried before the rendezvous fails with
                       RendezvousConnectionError (default 30)
join_timeout           torch's: seconds for a round to complete (default 600)
last_call_timeout      torch's: extra wait once ``min`` nodes joined (default 30)
close_timeout          torch's: seconds to close the rendezvous (default 30)
heartbeat_timeout      torch's: seconds one keep-alive may take (default 5; alias heartbeat)
keep_alive_interval    torch's: seconds between keep-alives (default 5)
keep_alive_max_attempt torch's: missed keep-alives before a node is dropped (default 3)
cacert, cert, key      TLS files (aliases ca_cert, ssl_cert, ssl_cert_key); https:// endpoints
user, password         etcd auth; else env MARIND_ETCD_USER / MARIND_ETCD_PASSWORD
=====================  ===============================================================

The endpoint is ``HOST:PORT``, ``https://HOST:PORT`` or a comma-separated list.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
)

from marind.core import workerenv as WE
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import DEFAULT_PREFIX, EtcdClient, EtcdTLS
from marind.core.log import get_logger
from marind.core.rdzv_keys import state_key
from marind.rendezvous.backend import Etcd3RendezvousBackend
from marind.rendezvous.lost import LossAwareStateHolder, LostNodes, publish_member
from marind.rendezvous.store import Etcd3Store

log = get_logger(__name__)


@dataclass(frozen=True)
class Etcd3Options:
    """How a rendezvous reaches etcd, read from ``--rdzv-endpoint`` and ``--rdzv-conf``.

    Attributes:
        endpoints: ``HOST:PORT``, ``https://HOST:PORT`` or a comma-separated list.
        prefix: the etcd key prefix (``prefix=``).
        read_timeout: seconds per etcd request (``read_timeout=``).
        store_timeout: seconds an agent waits on a store key (``store_timeout=``).
        grace_timeout: seconds an etcd outage is retried before the rendezvous fails
            (``etcd_grace_timeout=``).
        user: etcd user (``user=``, else ``MARIND_ETCD_USER``), or None.
        password: its password (``password=``, else ``MARIND_ETCD_PASSWORD``), or None.
        tls: CA and client certificate files (``cacert=``, ``cert=``, ``key=``).
    """

    endpoints: str
    prefix: str = DEFAULT_PREFIX
    read_timeout: float = 10.0
    store_timeout: float = 60.0
    grace_timeout: float = 30.0
    user: str | None = None
    password: str | None = None
    tls: EtcdTLS = EtcdTLS()


def _positive(params: RendezvousParameters, key: str, default: int) -> int:
    value = params.get_as_int(key, default)
    if value is None or value <= 0:
        raise ValueError(f"--rdzv-conf {key}={value!r}: must be a positive number of seconds")
    return value


def _first(params: RendezvousParameters, *keys: str) -> str | None:
    for key in keys:
        value = params.get(key)
        if value not in (None, ""):
            return str(value)
    return None


def parse_options(params: RendezvousParameters, env: Mapping[str, str] | None = None) -> Etcd3Options:
    """The etcd connection settings of a rendezvous (pure: no I/O).

    Args:
        params: torchrun's rendezvous parameters (``--rdzv-endpoint``, ``--rdzv-conf``).
        env: where ``MARIND_ETCD_USER``/``MARIND_ETCD_PASSWORD`` are read (default ``os.environ``).

    Returns:
        The options; ``protocol=https`` puts ``https://`` before every endpoint without a scheme.

    Raises:
        ValueError: no endpoint; a user without a password or the reverse; a client
            certificate without its key or the reverse; a timeout that is not a positive number.
    """
    env = os.environ if env is None else env
    endpoints = (params.endpoint or "").strip()
    if not endpoints:
        raise ValueError("--rdzv-endpoint is required for the etcd3 backend: give HOST:PORT of etcd")
    if (params.get("protocol") or "").lower() == "https":
        endpoints = ",".join(e if "://" in e else "https://" + e.strip() for e in endpoints.split(","))
    user = _first(params, "user") or env.get("MARIND_ETCD_USER") or None
    password = _first(params, "password") or env.get("MARIND_ETCD_PASSWORD") or None
    if bool(user) != bool(password):
        raise ValueError("etcd auth needs both a user and a password "
                         "(--rdzv-conf user=...,password=... or MARIND_ETCD_USER/MARIND_ETCD_PASSWORD)")
    tls = EtcdTLS(ca_cert=_first(params, "cacert", "ca_cert"),
                  cert=_first(params, "cert", "ssl_cert"),
                  key=_first(params, "key", "ssl_cert_key"))
    if bool(tls.cert) != bool(tls.key):
        raise ValueError("a TLS client certificate needs both cert= and key= in --rdzv-conf")
    return Etcd3Options(
        endpoints=endpoints,
        prefix=_first(params, "prefix") or DEFAULT_PREFIX,
        read_timeout=_positive(params, "read_timeout", 10),
        store_timeout=_positive(params, "store_timeout", 60),
        grace_timeout=_positive(params, "etcd_grace_timeout", 30),
        user=user, password=password, tls=tls)


def _timeouts(params: RendezvousParameters) -> RendezvousTimeout:
    def seconds(*keys: str) -> timedelta | None:
        for key in keys:
            if params.get(key) is not None:
                return timedelta(seconds=_positive(params, key, 1))
        return None
    return RendezvousTimeout(join=seconds("join_timeout"), last_call=seconds("last_call_timeout"),
                             close=seconds("close_timeout"),
                             heartbeat=seconds("heartbeat_timeout", "heartbeat"))


def connect(options: Etcd3Options, run_id: str = "") -> EtcdClient:
    """An EtcdClient that has answered once, its credentials checked against the job's keys.

    Args:
        options: how to reach etcd.
        run_id: the rendezvous (job) id; its state key is read once to check access.

    Returns:
        The connected client.

    Raises:
        RendezvousConnectionError: etcd is unreachable or refuses the credentials; the
            message names the endpoint and ``--rdzv-endpoint``.
    """
    try:
        client = EtcdClient(options.endpoints, prefix=options.prefix, user=options.user,
                            password=options.password, tls=options.tls, timeout=options.read_timeout)
        client.ping()
        client.get(state_key(client, run_id or "_"))  # auth reaches the prefix
    except ControlPlaneUnavailable as exc:
        # the wrapper's advice names marind's own flags; under torchrun it is --rdzv-endpoint
        detail = str(exc).replace("or pass --etcd / set MARIND_ETCD", "and --rdzv-endpoint")
        raise RendezvousConnectionError(f"etcd3 rendezvous '{run_id}': {detail}") from exc
    return client


class Etcd3RendezvousHandler(DynamicRendezvousHandler):
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

    Made by ``create_handler`` (through torch's ``from_backend``); its public
    methods are torch's ``RendezvousHandler`` API (``next_rendezvous``,
    ``is_closed``, ``set_closed``, ``num_nodes_waiting``, ``shutdown``, ...).
    """

    @classmethod
    def with_lost_nodes(cls, run_id: str, store: Etcd3Store, backend: Etcd3RendezvousBackend,
                        client: EtcdClient, min_nodes: int, max_nodes: int, local_addr: str | None,
                        timeout: RendezvousTimeout, keep_alive_interval: int,
                        keep_alive_max_attempt: int) -> Etcd3RendezvousHandler:
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


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A ``DynamicRendezvousHandler`` on etcd v3 for ``params`` (see the module doc).

    Args:
        params: torchrun's rendezvous parameters: the endpoint, the run id, min and
            max nodes, the local address and ``--rdzv-conf`` (options in the module doc).

    Returns:
        An ``Etcd3RendezvousHandler`` whose state is ``Etcd3RendezvousBackend``'s key
        and whose store is an ``Etcd3Store``, both under ``{prefix}/jobs/{run_id}/rdzv/``.

    Raises:
        ValueError: a bad option (``parse_options``).
        RendezvousConnectionError: etcd cannot be reached with these settings (``connect``).
    """
    options = parse_options(params)
    use_frame_method_names()
    timeout = _timeouts(params)
    keep_alive_interval = _positive(params, "keep_alive_interval", 5)
    keep_alive_max_attempt = _positive(params, "keep_alive_max_attempt", 3)
    client = connect(options, params.run_id)
    backend = Etcd3RendezvousBackend(client, params.run_id, grace=options.grace_timeout)
    store = Etcd3Store(client, params.run_id, timeout=timedelta(seconds=options.store_timeout),
                       grace=options.grace_timeout)
    log.info("rdzv_etcd3", run_id=params.run_id, endpoints=options.endpoints, key=backend.key,
             min_nodes=params.min_nodes, max_nodes=params.max_nodes)
    handler = Etcd3RendezvousHandler.with_lost_nodes(
        params.run_id, store, backend, client, params.min_nodes, params.max_nodes, params.local_addr,
        timeout, keep_alive_interval, keep_alive_max_attempt)
    node = os.environ.get(WE.NODE)
    if node:   # started by a marind agent: say which torchrun is this node's (for mark_lost)
        try:
            publish_member(client, params.run_id, node, handler._this_node)
        except ControlPlaneUnavailable as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous '{params.run_id}': {exc}") from exc
    return handler

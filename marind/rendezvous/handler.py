"""``create_handler``: what ``torchrun --rdzv-backend=etcd3`` ends up calling.

Options come from ``--rdzv-conf key=value,...`` (``params.config``):

=====================  ===============================================================
prefix                 etcd key prefix (default ``/marind``)
read_timeout           seconds per etcd request (default 10)
store_timeout          seconds an agent waits on a store key (default 60, as c10d)
etcd_grace_timeout     seconds an etcd outage is retried before the rendezvous fails with
                       RendezvousConnectionError (default 30)
join_timeout           torch's: seconds for a round to take this node (default 600)
last_call_timeout      torch's: extra wait once ``min`` nodes joined (default 30)
close_timeout          torch's: most seconds ``set_closed``/``shutdown`` retry an etcd outage (default 30)
heartbeat_timeout      torch's option, accepted (alias heartbeat); a keep-alive here is one lease
                       renewal, bounded by read_timeout, in a thread of its own
keep_alive_interval    torch's: seconds between lease renewals (default 5)
keep_alive_max_attempt torch's: the lease lasts interval x attempts (default 3); a torchrun that
                       stops renewing leaves the rendezvous when it expires
cacert, cert, key      TLS files (aliases ca_cert, ssl_cert, ssl_cert_key); https:// endpoints
user, password         etcd auth; else env MARIND_ETCD_USER / MARIND_ETCD_PASSWORD
=====================  ===============================================================

The endpoint is ``HOST:PORT``, ``https://HOST:PORT`` or a comma-separated list.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

from marind.core import workerenv as WE
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import DEFAULT_PREFIX, EtcdClient
from marind.core.etcd_endpoints import EtcdTLS
from marind.core.log import get_logger
from marind.core.rdzv_keys import latest_key
from marind.rendezvous.etcd3_handler import Etcd3RendezvousHandler
from marind.rendezvous.lost import publish_member
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
        run_id: the rendezvous (job) id; one of its keys is read once to check access.

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
        client.get(latest_key(client, run_id or "_"))  # auth reaches the prefix
    except ControlPlaneUnavailable as exc:
        # the wrapper's advice names marind's own flags; under torchrun it is --rdzv-endpoint
        detail = str(exc).replace("or pass --etcd / set MARIND_ETCD", "and --rdzv-endpoint")
        raise RendezvousConnectionError(f"etcd3 rendezvous '{run_id}': {detail}") from exc
    return client


def settings_of(params: RendezvousParameters) -> RendezvousSettings:
    """torch's settings from torchrun's parameters: run id, min/max nodes, timeouts, keep-alive.

    Raises:
        ValueError: a timeout or keep-alive option that is not a positive number of seconds.
    """
    return RendezvousSettings(
        params.run_id, params.min_nodes, params.max_nodes, _timeouts(params),
        keep_alive_interval=timedelta(seconds=_positive(params, "keep_alive_interval", 5)),
        keep_alive_max_attempt=_positive(params, "keep_alive_max_attempt", 3))


def create_handler(params: RendezvousParameters, node: str | None = None) -> RendezvousHandler:
    """The etcd v3 rendezvous handler for ``params`` (see the module doc).

    Args:
        params: torchrun's rendezvous parameters: the endpoint, the run id, min and
            max nodes, the local address and ``--rdzv-conf`` (options in the module doc).
        node: the marind node this torchrun belongs to (default ``MARIND_NODE``; the
            cluster simulator, ``bench/scale.py``, runs many nodes in one process).

    Returns:
        An ``Etcd3RendezvousHandler`` (per-round keys, ``marind.rendezvous.rounds``) whose
        store is an ``Etcd3Store``, both under ``{prefix}/jobs/{run_id}/rdzv/``.

    Raises:
        ValueError: a bad option (``parse_options``), or bad min/max nodes.
        RendezvousConnectionError: etcd cannot be reached with these settings (``connect``).
    """
    options = parse_options(params)
    settings = settings_of(params)
    client = connect(options, params.run_id)
    store = Etcd3Store(client, params.run_id, timeout=timedelta(seconds=options.store_timeout),
                       grace=options.grace_timeout)
    log.info("rdzv_etcd3", run_id=params.run_id, endpoints=options.endpoints, min_nodes=params.min_nodes,
             max_nodes=params.max_nodes)
    handler = Etcd3RendezvousHandler(client, store, settings, params.local_addr, grace=options.grace_timeout)
    node = node or os.environ.get(WE.NODE)
    if node:   # started by a marind agent: say which torchrun is this node's (for mark_lost)
        try:
            publish_member(client, params.run_id, node, handler._this_node)
        except ControlPlaneUnavailable as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous '{params.run_id}': {exc}") from exc
    return handler

"""Where a cluster check lives in etcd (docs/design.md §2), and its request record.

    {p}/doctor/requests/{id}             the request (the CLI's lease): which hosts, in rank order
    {p}/doctor/runs/{id}/addr/{node}     a probe's TCP listener: {node, host, addr, port}
    {p}/doctor/runs/{id}/reach/{node}    whom that probe reached: {peer: outcome}
    {p}/doctor/runs/{id}/plan            the group: {members, excluded}; the first probe to decide writes it
    {p}/doctor/runs/{id}/result/{node}   that host's row (``verdict.HostResult``)
    {p}/doctor/runs/{id}/pg/jobs/doctor/rdzv/store/...   the process group's store (``Etcd3Store`` on a client
                                         whose prefix is ``runs/{id}/pg``)

Agents watch ``{p}/doctor/requests/``; the CLI deletes the request and the run's keys when done.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import asdict, dataclass

from marind.core.etcd_client import EtcdClient

DEFAULT_BYTES = 32 * 2**20
DEFAULT_TIMEOUT_S = 90.0
_ID = re.compile(r"^[a-z0-9-]{1,64}$")


def requests_prefix(client: EtcdClient) -> str:
    """``{p}/doctor/requests/``: what agents watch."""
    return client.key("doctor", "requests") + "/"


def request_key(client: EtcdClient, request_id: str) -> str:
    """``{p}/doctor/requests/{id}``."""
    return client.key("doctor", "requests", request_id)


def run_prefix(client: EtcdClient, request_id: str) -> str:
    """``{p}/doctor/runs/{id}/``: every key of one check but its request."""
    return client.key("doctor", "runs", request_id) + "/"


def run_key(client: EtcdClient, request_id: str, *parts: str) -> str:
    """A key under the run: ``run_key(c, id, "addr", node)``."""
    return client.key("doctor", "runs", request_id, *parts)


def new_request_id() -> str:
    """A fresh id: UTC time and 4 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class Request:
    """One cluster check.

    Args:
        id: the request's id.
        hosts: the registered nodes, in rank order.
        bytes: the bandwidth all-reduce's size.
        timeout_s: how long the whole check may take; every probe phase fits in it.
        by: ``user@host`` of the CLI.
    """

    id: str
    hosts: tuple[str, ...]
    bytes: int = DEFAULT_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    by: str = ""

    def to_dict(self) -> dict:
        """The JSON value of the request key."""
        return asdict(self) | {"hosts": list(self.hosts)}

    @classmethod
    def from_dict(cls, doc: dict) -> Request:
        """Parse a request key's value.

        Raises:
            ValueError: not a request (missing or bad fields).
        """
        try:
            req = cls(id=str(doc["id"]), hosts=tuple(str(h) for h in doc["hosts"]), bytes=int(doc["bytes"]),
                      timeout_s=float(doc["timeout_s"]), by=str(doc.get("by", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a cluster-check request: {exc!r}") from exc
        if not _ID.match(req.id) or not req.hosts or req.bytes < 4 or req.timeout_s <= 0:
            raise ValueError(f"not a cluster-check request: {doc!r}")
        return req


@dataclass(frozen=True)
class Phases:
    """How a probe splits the request's time (seconds, from its start).

    Args:
        gather_s: waiting for every host's listener, then for every host's reachability row.
        connect_s: one TCP connect to a peer.
        collective_s: the process group's timeout (joining it and each collective).
    """

    gather_s: float
    connect_s: float
    collective_s: float

    @classmethod
    def of(cls, timeout_s: float) -> Phases:
        """The phases of a check bounded by ``timeout_s``: gathering twice, connecting and one
        collective's timeout fit in it, so a collective that times out is reported as such
        before the probe's watchdog fires."""
        return cls(gather_s=max(1.0, timeout_s * 0.15), connect_s=max(0.5, min(5.0, timeout_s * 0.05)),
                   collective_s=max(3.0, timeout_s * 0.4))

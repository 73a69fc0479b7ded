"""Each etcd member's health and who leads, asked of every endpoint on its own.

The client (``marind.core.etcd_client``) talks to whichever member answers; an operator, and
``marind doctor``, want to see every member: is it up, which member id it is, which member
it believes leads, its raft term and database size. A member that answers but sees no
leader (``leader == 0``) has lost quorum; two members that name different leaders are in
the middle of an election.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3 import exceptions as etcd_exc

from marind.core.etcd_endpoints import EtcdTLS, parse_endpoints


@dataclass(frozen=True)
class MemberStatus:
    """One endpoint's answer (``error`` set and the rest empty when it gave none)."""

    endpoint: str
    healthy: bool
    member_id: int = 0
    leader_id: int = 0
    raft_term: int = 0
    db_size: int = 0
    version: str = ""
    error: str = ""

    @property
    def is_leader(self) -> bool:
        return self.healthy and self.member_id != 0 and self.member_id == self.leader_id

    def to_dict(self) -> dict:
        return dict(asdict(self), member_id=f"{self.member_id:x}", leader_id=f"{self.leader_id:x}",
                    is_leader=self.is_leader)


def member_status(endpoint: str, *, timeout: float = 2.0, tls: EtcdTLS | None = None,
                  user: str | None = None, password: str | None = None) -> MemberStatus:
    """Ask one endpoint for its status (the maintenance API's Status call, no other request).

    Args:
        endpoint: ``http://HOST:PORT`` (or ``https://``).
        timeout: seconds to wait for the answer.
        tls: certificates for an https endpoint.
        user, password: etcd credentials, when auth is on.

    Returns:
        The member's status; ``healthy`` is False with ``error`` set when it did not answer or
        answered that it sees no leader.
    """
    (host, port, secure), = parse_endpoints(endpoint)
    tls = tls or EtcdTLS()
    client = None
    try:
        client = etcd3.client(host=host, port=port, timeout=timeout, user=user, password=password,
                              ca_cert=tls.ca_cert if secure else None, cert_key=tls.key if secure else None,
                              cert_cert=tls.cert if secure else None)
        resp = client.maintenancestub.Status(etcdrpc.StatusRequest(), timeout, credentials=client.call_credentials,
                                             metadata=client.metadata)
    except (grpc.RpcError, etcd_exc.Etcd3Exception, OSError, ValueError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)
        return MemberStatus(endpoint=endpoint, healthy=False, error=f"{type(exc).__name__}: {detail}".strip())
    finally:
        if client is not None:
            client.close()
    leader = int(resp.leader)
    errors = list(getattr(resp, "errors", []) or [])
    problem = "; ".join(errors) or ("no leader (quorum lost?)" if leader == 0 else "")
    return MemberStatus(endpoint=endpoint, healthy=not problem, member_id=int(resp.header.member_id),
                        leader_id=leader, raft_term=int(resp.raftTerm), db_size=int(resp.dbSize),
                        version=str(resp.version), error=problem)


def cluster_status(endpoints: str | list[str], **kwargs) -> list[MemberStatus]:
    """``member_status`` of every endpoint given, in the order given."""
    items = endpoints if isinstance(endpoints, list) else [e.strip() for e in endpoints.split(",") if e.strip()]
    return [member_status(e if "://" in e else f"http://{e}", **kwargs) for e in items]


def leader_endpoint(statuses: list[MemberStatus]) -> str | None:
    """The endpoint of the member the healthy members agree leads; None without one."""
    leaders = {s.leader_id for s in statuses if s.healthy}
    if len(leaders) != 1:
        return None
    (leader,) = leaders
    return next((s.endpoint for s in statuses if s.healthy and s.member_id == leader), None)

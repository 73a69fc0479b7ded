"""The agent's connection to the control plane: one etcd client and what hangs off it.

Made once when the agent starts (``Link.open``), before the node is
registered; the agent's loop reaches etcd only through these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from marind.agent.ft.pending import PendingCoordinators
from marind.agent.outbox import Outbox
from marind.agent.registry import NodeRegistry
from marind.control.change_watch import ChangeWatch
from marind.control.config import AgentConfig
from marind.core.etcd_client import EtcdClient


@dataclass(frozen=True)
class Link:
    """The client, the jobs' change watch, the node's registration, the outbox and the
    torchft coordinators waiting for a slot."""

    client: EtcdClient
    watch: ChangeWatch
    registry: NodeRegistry
    outbox: Outbox
    ft_pending: PendingCoordinators

    @classmethod
    def open(cls, config: AgentConfig, endpoint: str, *, slots: int, online: Callable[[], bool],
             offline: Callable[[], None], on_keepalive_failure: Callable[[], None]) -> Link:
        """Make the client and its companions (no etcd request yet).

        Args:
            config: the agent's settings (prefix, credentials, TLS, labels, lease TTL).
            endpoint: etcd's endpoints.
            slots: the node's slots (registered with the node).
            online: whether etcd is believed reachable (the outbox flushes at once then).
            offline: called when a write finds etcd unreachable.
            on_keepalive_failure: called when the node's lease keep-alive fails.

        Returns:
            The link.
        """
        c = config
        client = EtcdClient(endpoint, prefix=c.prefix, user=c.etcd_user, password=c.etcd_password, tls=c.tls)
        registry = NodeRegistry(client, c.node, slots=slots, labels=dict(c.labels), ttl=c.lease_ttl,
                                on_keepalive_failure=on_keepalive_failure)
        outbox = Outbox(client, c.node, online=online, offline=offline)
        pending = PendingCoordinators(client, c.node, host=lambda: str(registry.record["host"]),
                                      lease=lambda: registry.lease)
        return cls(client, ChangeWatch(client), registry, outbox, pending)

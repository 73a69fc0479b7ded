"""The registered nodes, as every reader sees them: ``{p}/nodes/{node}`` (each under its agent's lease).

The agent writes them (``marind.agent.registry``); the CLI and the agent's loop read them here.
"""

from __future__ import annotations

from marind.core.etcd_client import EtcdClient


def live_nodes(client: EtcdClient) -> dict[str, dict]:
    rows = client.get_prefix_json(client.key("nodes") + "/")
    return {k.rsplit("/", 1)[-1]: v for k, v in rows.items() if isinstance(v, dict)}

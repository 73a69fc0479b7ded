"""The etcd keys of a job's rendezvous, one place for both sides (``docs/design.md`` §2).

The rendezvous handler inside each torchrun writes them and the agents read
them (``marind.agent.membership``); the agent never imports the rendezvous
package, so the spelling lives here, under ``{p}/jobs/{run_id}/rdzv/``:

* ``state`` — torch's serialised rendezvous state (compare-and-set);
* ``store/`` — the workers' key-value store of each round;
* ``members/{node}`` — ``{desc, pid, at}``, the node's torchrun's descriptor;
* ``round`` — the number and participants of the last completed round;
* ``lost/{desc}`` — one marker per torchrun the agents declared lost.
"""

from __future__ import annotations

from marind.core.etcd_client import EtcdClient


def _rdzv(client: EtcdClient, run_id: str, *parts: str) -> str:
    return client.key("jobs", run_id, "rdzv", *parts)


def state_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/state``: torch's rendezvous state."""
    return _rdzv(client, run_id, "state")


def store_base(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/store/``: the prefix of the workers' store."""
    return _rdzv(client, run_id, "store") + "/"


def members_key(client: EtcdClient, run_id: str, node: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/members/{node}``: the node's torchrun's descriptor."""
    return _rdzv(client, run_id, "members", node)


def round_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/round``: the last completed round's number and participants."""
    return _rdzv(client, run_id, "round")


def lost_prefix(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/lost/``: one key per lost torchrun."""
    return _rdzv(client, run_id, "lost") + "/"


def lost_key(client: EtcdClient, run_id: str, desc: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/lost/{desc}``: the marker of one lost torchrun."""
    return lost_prefix(client, run_id) + desc

"""The etcd keys of a job's rendezvous, one place for both sides (``docs/design.md`` §2).

The rendezvous handler inside each torchrun writes them and the agents read
them (``marind.agent.membership``); the agent never imports the rendezvous
package, so the spelling lives here, under ``{p}/jobs/{run_id}/rdzv/``:

* ``rounds/{n}/join/{desc}`` — a torchrun taking part in round ``n`` (its lease);
* ``rounds/{n}/spare/{desc}`` — a torchrun waiting for a place while round ``n - 1`` is full;
* ``rounds/{n}/closer`` — the one torchrun that closes round ``n`` (its lease);
* ``rounds/{n}/rank/{desc}`` — ``{rank, by}``: the rank of participant ``desc`` of round ``n``,
  written by the round's closer ``by`` before it closes the round;
* ``rounds/{n}/closed`` — ``{round, world_size, at, by}``: round ``n`` is closed, written once;
* ``latest`` — the number of the last closed round (text);
* ``closed`` — the rendezvous is closed: no more rounds (``set_closed``, ``shutdown``);
* ``store/`` — the workers' key-value store of each round;
* ``members/{node}`` — ``{desc, pid, at}``, the node's torchrun's descriptor;
* ``round`` — the last closed round's ``rounds/{n}/closed`` value (for the agents);
* ``lost/{desc}`` — one marker per torchrun the agents declared lost;
* ``state`` — the single-key state of the earlier implementation
  (``marind.rendezvous.state_handler``), which torchrun no longer uses.
"""

from __future__ import annotations

from marind.core.etcd_client import EtcdClient


def _rdzv(client: EtcdClient, run_id: str, *parts: str) -> str:
    return client.key("jobs", run_id, "rdzv", *parts)


def state_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/state``: the single-key state (``state_handler`` only)."""
    return _rdzv(client, run_id, "state")


def store_base(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/store/``: the prefix of the workers' store."""
    return _rdzv(client, run_id, "store") + "/"


def members_key(client: EtcdClient, run_id: str, node: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/members/{node}``: the node's torchrun's descriptor."""
    return _rdzv(client, run_id, "members", node)


def round_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/round``: the last closed round (``rounds/{n}/closed``'s value)."""
    return _rdzv(client, run_id, "round")


def lost_prefix(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/lost/``: one key per lost torchrun."""
    return _rdzv(client, run_id, "lost") + "/"


def lost_key(client: EtcdClient, run_id: str, desc: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/lost/{desc}``: the marker of one lost torchrun."""
    return lost_prefix(client, run_id) + desc


def closed_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/closed``: present once the rendezvous is closed."""
    return _rdzv(client, run_id, "closed")


def latest_key(client: EtcdClient, run_id: str) -> str:
    """``{p}/jobs/{run_id}/rdzv/latest``: the number of the last closed round (text)."""
    return _rdzv(client, run_id, "latest")


def round_prefix(client: EtcdClient, run_id: str, round_: int) -> str:
    """``{p}/jobs/{run_id}/rdzv/rounds/{n}/``: every key of round ``n``."""
    return _rdzv(client, run_id, "rounds", str(round_)) + "/"


def join_prefix(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/join/``: one key per torchrun taking part in round ``n``."""
    return round_prefix(client, run_id, round_) + "join/"


def spare_prefix(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/spare/``: one key per torchrun waiting for a place in round ``n``."""
    return round_prefix(client, run_id, round_) + "spare/"


def closer_key(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/closer``: the descriptor of the torchrun that closes round ``n``."""
    return round_prefix(client, run_id, round_) + "closer"


def round_closed_key(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/closed``: round ``n`` is closed (its size and closer, no names)."""
    return round_prefix(client, run_id, round_) + "closed"


def rank_prefix(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/rank/``: one key per participant of round ``n``, its rank."""
    return round_prefix(client, run_id, round_) + "rank/"


def rank_key(client: EtcdClient, run_id: str, round_: int, desc: str) -> str:
    """``.../rounds/{n}/rank/{desc}``: ``{rank, by}``, participant ``desc``'s rank in round ``n``."""
    return rank_prefix(client, run_id, round_) + desc


def close_watch_prefix(client: EtcdClient, run_id: str, round_: int) -> str:
    """``.../rounds/{n}/close``: the prefix of exactly ``closer`` and ``closed`` (one watch)."""
    return round_prefix(client, run_id, round_) + "close"

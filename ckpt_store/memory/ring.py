"""Where a memory checkpoint's parts live, and what a loss of nodes leaves (pure functions).

The nodes of a world are numbered in the order of their lowest global rank. Node ``i``
keeps its ranks' objects in its own host memory and sends a copy to node ``i + 1``
(mod ``n``): a ring. So node ``i``'s objects are on nodes ``{i, i + 1}``, and they
survive a loss of nodes unless both are lost (a *replica pair*). A world of one node has
no replica: its memory checkpoints survive a restart of its processes, not of the host.
Every decision returns its reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def node_order(hosts_by_rank: Sequence[str]) -> list[str]:
    """The world's nodes, in the order of their lowest global rank (``hosts_by_rank[r]``:
    the host of rank ``r``)."""
    order: list[str] = []
    for host in hosts_by_rank:
        if host not in order:
            order.append(host)
    return order


def replica_target(node: int, nodes: int) -> int | None:
    """The node that keeps node ``node``'s replica; None in a world of one node."""
    if not 0 <= node < nodes:
        raise ValueError(f"node {node} is not in a world of {nodes} nodes")
    return (node + 1) % nodes if nodes > 1 else None


def holders(node: int, nodes: int) -> set[int]:
    """The nodes that hold node ``node``'s objects (its own copy, and its replica)."""
    target = replica_target(node, nodes)
    return {node} if target is None else {node, target}


def lost_parts(nodes: int, lost: Iterable[int]) -> list[int]:
    """The nodes whose objects no survivor holds after ``lost`` are gone (both holders lost)."""
    gone = set(lost)
    return [i for i in range(nodes) if holders(i, nodes) <= gone]


def survives(nodes: int, lost: Iterable[int]) -> tuple[bool, str]:
    """Whether a memory checkpoint written by a world of ``nodes`` nodes is whole on the
    survivors of ``lost``; and why.

    Returns:
        (True, reason) when every node's objects are on a survivor; else (False, the pairs lost).
    """
    gone = sorted(set(lost))
    if not gone:
        return True, "no node lost"
    if len(gone) >= nodes:
        return False, f"every node of {nodes} lost"
    missing = lost_parts(nodes, gone)
    if not missing:
        return True, f"nodes {gone} lost; every lost node's replica is on a survivor"
    pairs = ", ".join(f"{i}+{replica_target(i, nodes)}" if nodes > 1 else f"{i}" for i in missing)
    return False, f"nodes {gone} lost with their replicas (pairs {pairs}): their parts are in no survivor's memory"


def memory_needed(own_bytes: int, replica_bytes: int, kept: int = 1) -> int:
    """Host memory a node's memory tier takes at most: its own ranks' snapshots plus the
    replica it keeps for the previous node, for each of the ``kept`` committed steps and
    the one being written (retention deletes the older step only once the newer commits)."""
    return (own_bytes + replica_bytes) * (kept + 1)


def memory_fits(needed: int, available: int, *, reserve: float = 0.1) -> tuple[bool, str]:
    """Whether ``needed`` bytes of memory checkpoints fit in ``available`` bytes of the host's
    memory, leaving ``reserve`` (a fraction of it) for everything else; and why (the figures)."""
    room = int(available * (1 - reserve))
    gib = 1 << 30
    figures = (f"needs {needed / gib:.2f} GiB (own snapshot + the peer's replica, for the kept step and the "
               f"one in flight); the host has {available / gib:.2f} GiB available, "
               f"{room / gib:.2f} GiB after a {reserve:.0%} reserve")
    if needed <= room:
        return True, figures
    return False, figures

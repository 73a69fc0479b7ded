"""Which node lost the data network, and what this node does about it (pure functions).

Each agent of a job publishes what its probes of the other nodes' data
endpoints found (its row, ``{p}/jobs/{job}/reach/{node}``, docs/design.md §2):
a ``ReachRow``. Every agent reads the same rows and reaches the same verdict
(``cut_off``): a node is **cut off** when it has reached none of its peers for
``window`` seconds and none of them has reached it for as long, while some
other node still reaches a peer (the majority view). When no node reaches any
other (two nodes, one link dead: each sees the other silent), the rows'
``link_up`` tell them apart: the nodes whose own data link is down are cut
off, if some node's link is up. Otherwise (every link keeps its carrier, a
switch dropping traffic; or every link lost it) nobody can tell which side
is lost, but a world of one node needs no data network: the first node by
name keeps the job and the others are cut off (they fence and hold, and
rejoin once a peer answers), instead of everyone waiting for
``job.hang_timeout``. When every node still reaches a peer but some pairs
cannot reach each other (a one-way drop between two of three nodes: TCP
needs both directions), the workers' collectives, which need every pair, are
stuck all the same: the fewest nodes whose removal leaves no such **broken
pair** are cut off (greedily: the node in most broken pairs first, the last
by name on a tie, so the first by name keeps the job), and each holds the
job until the peers it could not reach answer it (``must_answer``).

``on_data_loss`` turns the verdict into this node's action, like
``decisions.on_node_loss``: a survivor whose workers stalled restarts them
into a new round without the cut-off node; the cut-off node fences its run.
Under torchft a survivor restarts nothing (its replica group's quorum drops
the cut-off one) and the cut-off node fences its group at once.

``probe_targets``: which peers a node probes. Not all of them: at thousands of
nodes all-to-all probing is a million connects a second. Each node probes the
``PROBE_FANOUT`` nodes after it on a ring that every agent orders alike (by a
hash of job and node name, so that the nodes of one rack, named alike, are
not each other's only probers); so each node is probed by as many. The
verdicts above need no more: a row says which peers it probed.

``commit_fence_due``: a node that has reached none of its peers for
``COMMIT_FENCE_S`` must not commit a checkpoint any more (its world may be
replaced); it says so before its row shows it isolated for ``window``. When
every other node is dead (etcd shows their leases unrenewed past the silent
window too), no world can replace this one: no fence (a torchft survivor of
its only peer's power-off commits again within seconds, not when the lost
host's lease expires).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: the ``node_lost`` cause of a node whose data network is gone (its lease lives on)
DATA_NETWORK_GONE = "data_network_gone"
#: a node that reached no peer for this long stops committing (well before ``window``)
COMMIT_FENCE_S = 2.0
#: how many peers each node probes (all of them in a job of at most this many + 1 nodes)
PROBE_FANOUT = 3


def probe_targets(job: str, me: str, nodes: frozenset[str] | set[str], fanout: int = PROBE_FANOUT) -> frozenset[str]:
    """The peers ``me`` probes: the ``fanout`` nodes after it on the job's ring (pure).

    Args:
        job: the job (the ring's order differs per job).
        me: this node.
        nodes: the job's nodes to probe among (``me`` may be among them or not).
        fanout: how many peers to probe.

    Returns:
        The peers, all of them when there are at most ``fanout``.
    """
    others = set(nodes) - {me}
    if len(others) <= fanout:
        return frozenset(others)
    ring = sorted(others | {me}, key=lambda n: (hashlib.sha1(f"{job}/{n}".encode()).hexdigest(), n))
    at = ring.index(me)
    return frozenset(ring[(at + i) % len(ring)] for i in range(1, fanout + 1))


@dataclass(frozen=True)
class ReachRow:
    """One node's published view of its peers' data endpoints."""

    node: str
    at: float                                   # when it was published
    link_up: bool                               # its own data link has its carrier
    probed: frozenset[str]                      # the peers it probes
    down: Mapping[str, float] = field(default_factory=dict)   # peer -> not answering steadily since

    @classmethod
    def from_data(cls, node: str, data: Any, at: float | None = None) -> ReachRow | None:
        """The row a node published (``reach_rows``), or None for a malformed one.

        Args:
            node: the node.
            data: its published row.
            at: when it held last (its key still there: now), in place of the row's own ``at``.
        """
        if not isinstance(data, Mapping):
            return None
        try:
            return cls(node=node, at=float(data["at"] if at is None else at), link_up=bool(data.get("link_up", True)),
                       probed=frozenset(str(p) for p in data.get("probed") or ()),
                       down={str(p): float(t) for p, t in (data.get("down") or {}).items()})
        except (KeyError, TypeError, ValueError):
            return None

    def reaches_none(self, peers: frozenset[str], now: float, window: float) -> bool:
        """It probes at least one of ``peers`` and every one of them has been down for ``window``."""
        probed = self.probed & peers
        return bool(probed) and all(p in self.down and now - self.down[p] >= window for p in probed)

    def down_for(self, peer: str, now: float, window: float) -> bool:
        """It has not reached ``peer`` for ``window`` (False when it does not probe ``peer``)."""
        return peer in self.probed and peer in self.down and now - self.down[peer] >= window


class ProbeRing:
    """``probe_targets`` of one node, hashed again only when the job's nodes change (the ring
    hashes every node; a node asks for its targets every tick).

    Args:
        job: the job.
        me: this node.
    """

    def __init__(self, job: str, me: str) -> None:
        self.job, self.me = job, me
        self._nodes: frozenset[str] | None = None
        self._targets: frozenset[str] = frozenset()

    def targets(self, nodes: frozenset[str]) -> frozenset[str]:
        if nodes != self._nodes:
            self._nodes, self._targets = nodes, probe_targets(self.job, self.me, nodes)
        return self._targets


def cut_off(rows: Mapping[str, ReachRow], *, now: float, window: float, fresh_s: float) -> tuple[frozenset[str], str]:
    """The nodes of a job that lost the data network, by the majority view of every node's row.

    Args:
        rows: each node's row (nodes without a row have no say and are not judged).
        now: the current time.
        window: how long a node must have reached nobody, and nobody it.
        fresh_s: rows published longer ago than this are ignored (their agent is away). A row
            read from etcd carries the time it was read (its key lives under its node's lease,
            ``reach_rows``); the rule still holds for rows judged in other ways (tests, tools).

    Returns:
        (the cut-off nodes, why); an empty set when nothing can be decided.
    """
    fresh = {n: r for n, r in rows.items() if now - r.at <= fresh_s}
    nodes = frozenset(fresh)
    if len(nodes) < 2:
        return frozenset(), "fewer than two nodes report their data reachability"
    isolated = {n for n, r in fresh.items() if r.reaches_none(nodes - {n}, now, window)}
    if not isolated:
        pairs = broken_pairs(fresh, now=now, window=window)
        if not pairs:
            return frozenset(), "every node reaches a peer on the data network"
        cut = fewest_to_cut(pairs)
        return cut, (f"every node reaches a peer but {', '.join('-'.join(p) for p in pairs)} have not reached each "
                     f"other for {window:g}s (the collectives need every pair): {sorted(cut)} cut off, the fewest "
                     "that leave no such pair")
    unreached = {n for n in isolated
                 if any(n in fresh[o].probed for o in nodes - {n})
                 and all(fresh[o].down_for(n, now, window) for o in nodes - {n} if n in fresh[o].probed)}
    connected = nodes - isolated
    if connected:
        cut = frozenset(unreached)
        if not cut:
            return cut, f"{sorted(isolated)} reach no peer but a peer still reaches them: wait"
        return cut, (f"{sorted(cut)} reached no peer for {window:g}s and no peer reached them, while "
                     f"{sorted(connected)} reach each other")
    down_links = frozenset(n for n in unreached if not fresh[n].link_up)
    if down_links and down_links != nodes:
        return down_links, (f"no node reaches another for {window:g}s; {sorted(down_links)} lost their own "
                            f"data link, {sorted(nodes - down_links)} did not")
    if unreached != nodes:
        return frozenset(), f"no node reaches another for {window:g}s and no side is the majority: cannot tell"
    keep = min(nodes)
    links = "every data link lost its carrier" if down_links else "every data link keeps its carrier"
    return nodes - {keep}, (f"no node reaches another for {window:g}s and {links}: no side can tell, so "
                            f"{keep} (first by name) keeps the job alone and {sorted(nodes - {keep})} are cut off")


def broken_pairs(rows: Mapping[str, ReachRow], *, now: float, window: float) -> list[tuple[str, str]]:
    """The pairs of nodes that have not reached each other for ``window`` (pure).

    A pair is broken when at least one of the two probes the other and each of them that does has had
    the other down for ``window``: a silence one way only (the other probe still answered) is not.

    Returns:
        The broken pairs, each ``(first, second)`` by name, sorted.
    """
    out = []
    for a, b in itertools.combinations(sorted(rows), 2):
        probes = [(x, y) for x, y in ((a, b), (b, a)) if y in rows[x].probed]
        if probes and all(rows[x].down_for(y, now, window) for x, y in probes):
            out.append((a, b))
    return out


def fewest_to_cut(pairs: list[tuple[str, str]]) -> frozenset[str]:
    """Nodes whose removal leaves none of ``pairs`` (pure; greedy, the same on every agent).

    The node in most of the pairs left goes first; on a tie the last by name, so that the first
    by name keeps the job, as when no side can tell (``cut_off``).
    """
    left, cut = set(pairs), set()
    while left:
        count = Counter(n for pair in left for n in pair)
        worst = max(count, key=lambda n: (count[n], n))
        cut.add(worst)
        left = {pair for pair in left if worst not in pair}
    return frozenset(cut)


def must_answer(row: ReachRow | None, peers: frozenset[str] | set[str]) -> frozenset[str]:
    """The peers a cut-off node must reach again before it starts its job again (pure).

    Args:
        row: its own row when it was cut off.
        peers: the job's other nodes that were not cut off.

    Returns:
        Nothing when it reached none of the peers it probes (its own network is gone: any peer that
        answers again shows it back); otherwise the peers among ``peers`` it could not reach (a
        broken pair: rejoining while they still cannot reach it would stall the world again).
    """
    if row is None or not row.probed or row.probed <= set(row.down):
        return frozenset()
    return frozenset(p for p in row.down if p in peers)


class DataAction(str, Enum):
    """``on_data_loss``'s verdict for this node."""

    NONE = "none"            # nothing to do
    WAIT = "wait"            # not yet: the workers still step
    RESTART = "restart"      # a peer is cut off: drop it and restart this node's workers now
    MARK = "mark"            # a peer is cut off: drop it from the rendezvous only
    FENCE = "fence"          # this node is cut off: stop its workers, rejoin when the data network is back


def on_data_loss(*, me: str, cut: frozenset[str], acted: frozenset[str], in_round: frozenset[str],
                 workers_running: bool, progress_at: float | None, now: float, stall_s: float,
                 torchft: bool = False) -> tuple[DataAction, frozenset[str], str]:
    """A verdict of ``cut_off``: what does this node do?

    Args:
        me: this node.
        cut: the cut-off nodes (``cut_off``).
        acted: cut-off nodes this node has acted on already.
        in_round: the nodes that ran workers when last seen.
        workers_running: this node's workers of the current round are running.
        progress_at: when this node's workers last made progress (None: not seen yet).
        now: the current time.
        stall_s: the stall that counts as stuck (``decisions.stall_window``).
        torchft: a torchft job: a cut-off node fences its replica group at once (even one
            that steps: alone, or with the lighthouse, it would train a world of its own, and
            the connected groups need the lighthouse back); the others only record the loss
            (their groups' quorum drops it, no restart).

    Returns:
        (the action, the nodes it is about, why).
    """
    stalled = progress_at is None or now - progress_at >= stall_s
    if torchft:
        return _on_torchft_data_loss(me, cut, acted)
    if me in cut:
        if workers_running and not stalled:
            return DataAction.WAIT, frozenset({me}), "cut off by the peers' view but the workers still step"
        return DataAction.FENCE, frozenset({me}), "this node's data network is gone: fence, rejoin once it is back"
    todo = cut - acted
    if not todo:
        return DataAction.NONE, frozenset(), "no cut-off peer left to act on"
    if not (todo & in_round) or not workers_running:
        return DataAction.MARK, todo, "the workers are not in a round with it: only the rendezvous forgets it"
    if not stalled:
        assert progress_at is not None
        return DataAction.WAIT, todo, f"training goes on (progress {now - progress_at:.1f}s ago)"
    return DataAction.RESTART, todo, "its data network is gone and the workers stalled: restart without it"


def _on_torchft_data_loss(me: str, cut: frozenset[str], acted: frozenset[str]) -> tuple[DataAction, frozenset[str], str]:
    if me in cut:
        return DataAction.FENCE, frozenset({me}), ("torchft: this node's replica group is cut off from the others: "
                                                   "fence it, give up its slot and the lighthouse, rejoin once the "
                                                   "data network is back")
    todo = cut - acted
    if not todo:
        return DataAction.NONE, frozenset(), "no cut-off peer left to act on"
    return DataAction.MARK, todo, "torchft: the other replica groups go on without it (no restart)"


def commit_fence_due(down: Mapping[str, float], probed: frozenset[str], now: float,
                     after_s: float = COMMIT_FENCE_S, dead: frozenset[str] = frozenset(),
                     others: frozenset[str] = frozenset()) -> float | None:
    """Since when this node may not commit: every peer it probes unreachable for ``after_s``.

    Unless every other node of the job is dead (``dead``: silent on the data network while etcd,
    which this node still reaches, shows its lease unrenewed past its silent window,
    ``marind.agent.liveness.silence``): then no live node is left to replace this node's world, and each
    dead one is fenced by its own lease file (a torchft survivor of its only peer's power-off).
    One live node that this node does not reach is enough to keep the fence: it may be the
    majority that judges this node cut off (its ring targets dead with its own switch, say).

    Args:
        down: peer -> unreachable since (this node's probes).
        probed: the peers it probes.
        now: the current time.
        after_s: how long they must all have been down.
        dead: peers silent on both networks.
        others: every other node of the job (not only the probed ones).

    Returns:
        When the isolation began (the fence time), or None (commits allowed).
    """
    if others and others <= dead:
        return None
    if not probed or any(p not in down for p in probed):
        return None
    since = max(down[p] for p in probed)
    return since if now - since >= after_s else None

"""The cluster check's decisions, pure: which hosts form the group, each host's row, the verdict.

Reachability is a matrix of TCP connects between the probes' listeners:
``reach[src][dst]`` is ``"ok"`` or why the connect failed (``timeout``,
``refused``, ``unreachable``, ...). The group is the largest set the
rule below leaves fully connected: while some link inside the set fails,
drop the host(s) with the most failed links (in and out) inside it. A host
whose data link is down fails every link, so it is dropped and the others
stay; a broken link between two otherwise healthy hosts drops both of its
ends; with two hosts that cannot reach each other both are dropped (nothing
tells which one is at fault). A host with no row at all (its probe never
reported) is never in the group.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

OK = "ok"


@dataclass(frozen=True)
class Group:
    """Who all-reduces: ``members`` in rank order, and why each other host is out."""

    members: tuple[str, ...]
    excluded: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON value of the plan key."""
        return {"members": list(self.members), "excluded": dict(self.excluded)}

    @classmethod
    def from_dict(cls, doc: Mapping) -> Group:
        """Parse the plan key's value."""
        return cls(tuple(doc.get("members", ())), dict(doc.get("excluded", {})))


def _failed(reach: Mapping[str, Mapping[str, str]], src: str, dst: str) -> bool:
    return reach.get(src, {}).get(dst) != OK


def link_failures(hosts: Sequence[str], reach: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """Each host's failed links, in and out, among ``hosts``."""
    return {h: sum(_failed(reach, h, o) + _failed(reach, o, h) for o in hosts if o != h) for h in hosts}


def describe_links(host: str, hosts: Sequence[str], reach: Mapping[str, Mapping[str, str]]) -> str:
    """What failed around ``host``: who cannot reach it, whom it cannot reach (with the outcome)."""
    others = [o for o in hosts if o != host]
    into = [f"{o} ({reach.get(o, {}).get(host, 'no report')})" for o in others if _failed(reach, o, host)]
    out = [f"{o} ({reach.get(host, {}).get(o, 'no report')})" for o in others if _failed(reach, host, o)]
    parts = []
    if into:
        parts.append("not reachable from " + ", ".join(into))
    if out:
        parts.append("cannot reach " + ", ".join(out))
    return "; ".join(parts) or "all links ok"


def choose_group(hosts: Sequence[str], reach: Mapping[str, Mapping[str, str]]) -> Group:
    """The hosts that all-reduce, given who reached whom.

    Args:
        hosts: every host of the request, in rank order.
        reach: ``reach[src][dst]``: ``"ok"`` or why ``src`` could not connect to ``dst``;
            a host absent from ``reach`` never reported.

    Returns:
        The group (members in ``hosts`` order) and a reason for each host left out.
    """
    excluded = {h: "its probe sent no reachability report (no agent, or it saw the request too late)"
                for h in hosts if h not in reach}
    members = [h for h in hosts if h in reach]
    while True:
        failures = link_failures(members, reach)
        worst = max(failures.values(), default=0)
        if worst == 0:
            break
        dropped = [h for h in members if failures[h] == worst]
        tie = " (as many failed links as every other host: the check cannot tell which one is at fault)"
        for h in dropped:
            excluded[h] = describe_links(h, members, reach) + (tie if len(dropped) == len(members) else "")
        members = [h for h in members if failures[h] != worst]
    return Group(tuple(members), excluded)


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float | None:
    """An all-reduce's bus bandwidth, bytes/s: ``2 (n-1)/n x bytes / time`` (None for n < 2)."""
    if world < 2 or seconds <= 0:
        return None
    return 2 * (world - 1) / world * nbytes / seconds


def median(values: Sequence[float]) -> float | None:
    """The median, None for no values."""
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class HostResult:
    """What one host's probe measured (the value of ``result/{node}``)."""

    node: str
    host: str = ""
    rank: int | None = None
    world_size: int = 0
    backend: str = ""
    latency_s: float | None = None
    bus_bandwidth: float | None = None
    error: str | None = None

    @classmethod
    def from_dict(cls, doc: Mapping) -> HostResult:
        """Parse a result key's value (unknown fields ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in names})


@dataclass(frozen=True)
class Row:
    """One host's line of the report (docs/design.md §5, ``doctor --cluster --json``)."""

    node: str
    host: str
    ok: bool
    reachable_from: int
    peers: int
    rank: int | None
    latency_s: float | None
    bus_bandwidth: float | None
    error: str | None


@dataclass(frozen=True)
class Report:
    """The whole check: a row per host, the failing hosts, the verdict."""

    request: str
    backend: str
    bytes: int
    world_size: int
    rows: tuple[Row, ...]
    failing: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Every host passed."""
        return not self.failing

    def to_dict(self) -> dict:
        """The ``--json`` document."""
        return {"schema_version": 1, "ok": self.ok, "request": self.request, "backend": self.backend,
                "bytes": self.bytes, "world_size": self.world_size, "failing": list(self.failing),
                "hosts": [asdict(r) for r in self.rows]}


def host_error(node: str, *, reported: bool, plan: Group | None, result: HostResult | None) -> str | None:
    """Why ``node`` fails the check, or None when it passed.

    Args:
        node: the host.
        reported: its probe published a listener (it saw the request).
        plan: the group the probes agreed on (None: no probe got that far).
        result: its probe's result (None: none in time).
    """
    if result is None and not reported:
        return "no probe reported: is `marind agent` running there and reaching etcd?"
    if plan is not None and node in plan.excluded:
        return plan.excluded[node]
    if result is None:
        return "its probe sent no result within the timeout"
    return result.error


def build_report(request_id: str, hosts: Sequence[str], nbytes: int, *, reported: Mapping[str, str],
                 reach: Mapping[str, Mapping[str, str]], plan: Group | None,
                 results: Mapping[str, HostResult]) -> Report:
    """The report of a check from what the probes wrote.

    Args:
        request_id: the request.
        hosts: the request's hosts, in rank order.
        nbytes: the bandwidth all-reduce's size.
        reported: hostname by node, for each host whose probe published a listener.
        reach: the reachability rows (``reach[src][dst]``).
        plan: the group (None when no probe wrote one).
        results: each host's result.

    Returns:
        The report; a host fails when it was left out of the group, reported an error, or
        reported nothing.
    """
    rows = []
    for node in hosts:
        res = results.get(node)
        err = host_error(node, reported=node in reported, plan=plan, result=res)
        peers = [o for o in hosts if o != node]
        rows.append(Row(node=node, host=res.host if res else reported.get(node, ""), ok=err is None,
                        reachable_from=sum(not _failed(reach, o, node) for o in peers), peers=len(peers),
                        rank=res.rank if res else None, latency_s=res.latency_s if res else None,
                        bus_bandwidth=res.bus_bandwidth if res else None, error=err))
    backend = next((r.backend for r in results.values() if r.backend), "")
    return Report(request=request_id, backend=backend, bytes=nbytes,
                  world_size=len(plan.members) if plan else 0, rows=tuple(rows),
                  failing=tuple(r.node for r in rows if not r.ok))

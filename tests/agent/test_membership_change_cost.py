"""A node joining or leaving costs each node of the job O(1) etcd bytes, not the job's N records.

K members of one job (the real ``Membership`` and ``report_record``, against an etcd of the
test's own) report until steady; then a node joins (its own first report reads the job's
records once) and every member reports and polls once; then its record is deleted (its lease
expired) and every member reports and polls until it has seen the loss. etcd's own counters
(``marind.testing.etcd_metrics``: requests, and bytes sent to clients, watch events included)
over each change, divided by K, must not grow from K = 8 to K = 32 (before issue 31's item 2
they did: every member read the job's K records back on each change, docs/design.md §7,
"10,000 nodes, on paper"). Counted, not timed.
"""

from __future__ import annotations

from marind.agent.membership import Membership, report_record
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_metrics import etcd_counters

PAD = 700                  # an agent's job record is ~0.8 KB
SIZES = (8, 32)


def _record(node: str, incarnation: str) -> dict:
    return {"node": node, "incarnation": incarnation, "workers": [{"rank": 0, "local_rank": 0, "pid": 1}],
            "padding": "x" * PAD}


def _change_cost(endpoint: str, k: int) -> dict[str, float]:
    """Per member: etcd requests and bytes sent for one join and for one leave among ``k`` members."""
    client = EtcdClient(endpoint, prefix=f"/cost{k}")
    members = [Membership(client, "j", f"n{i:02d}", str(i)) for i in range(k)]
    joiner = Membership(client, "j", "new", "99")
    try:
        def report(group: list[Membership]) -> list[list[str]]:
            for m in group:
                report_record(client, "j", m.node, _record(m.node, m.incarnation), None, m)
            return [[loss.node for loss in m.poll()] for m in group]

        def per_member(before: dict, after: dict) -> tuple[float, float]:
            return (after["requests"] - before["requests"]) / k, (after["bytes_out"] - before["bytes_out"]) / k

        report(members)                                   # the first report: every record read once
        assert report(members) == [[]] * k                # steady: a count
        start = etcd_counters(endpoint)
        assert report([joiner]) == [[]]                   # the joiner reads the job's records once ...
        assert report(members) == [[]] * k                # ... each member learns of it
        assert all(m.known.get("new") == "99" for m in members)
        joined = etcd_counters(endpoint)

        client.delete(client.key("jobs", "j", "nodes", "new"))      # its lease expired
        seen = [loss for losses in report(members) for loss in losses]
        assert seen == ["new"] * k, seen
        left = etcd_counters(endpoint)
        join_requests, join_bytes = per_member(start, joined)
        leave_requests, leave_bytes = per_member(joined, left)
        return {"join_requests": join_requests, "join_bytes": join_bytes,
                "leave_requests": leave_requests, "leave_bytes": leave_bytes}
    finally:
        for m in [*members, joiner]:
            m.close()
        client.close()


def test_a_join_or_a_leave_costs_each_node_the_same_at_8_and_32_nodes(etcd_private):
    costs = {k: _change_cost(etcd_private.endpoint, k) for k in SIZES}
    print(f"\nper member and change: {costs}")
    small, large = (costs[k] for k in SIZES)
    for what in ("join_bytes", "leave_bytes", "join_requests", "leave_requests"):
        # 4x the members: the same per member (a little slack for etcd's varint sizes), where
        # reading the job's records back would make it ~3.6x
        assert large[what] <= 1.25 * small[what] + 64, (what, costs)
    record = len(str(_record("n00", "0")))
    assert large["join_bytes"] < 4 * record and large["leave_bytes"] < 4 * record, costs

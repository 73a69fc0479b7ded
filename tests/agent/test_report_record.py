"""A node's report is one etcd request: its record written and the job's records read back together.

Counted by a private etcd's own metrics (``marind.testing.etcd_metrics``), not timed.
"""

from __future__ import annotations

from marind.agent.membership import Membership, report_record
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_metrics import etcd_counters


def test_the_report_writes_and_reads_in_one_request_and_the_poll_uses_it(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/rep")
    try:
        lease = client.lease(30)
        members = Membership(client, "j", "a", "1")
        client.put_json(client.key("jobs", "j", "nodes", "b"), {"node": "b", "incarnation": "2"})
        before = etcd_counters(etcd_private.endpoint)["requests"]
        report_record(client, "j", "a", {"node": "a", "incarnation": "1"}, lease, members)
        assert members.poll() == []                                  # used what the report read
        assert etcd_counters(etcd_private.endpoint)["requests"] - before == 1
        assert client.lease_of(client.key("jobs", "j", "nodes", "a")) == lease.id
        assert set(members.known) == {"a", "b"}

        client.delete(client.key("jobs", "j", "nodes", "b"))       # b goes: the next report's read sees it
        report_record(client, "j", "a", {"node": "a", "incarnation": "1"}, lease, members)
        assert [loss.node for loss in members.poll()] == ["b"]
        assert members.poll() == []                                  # a poll without a report reads again
    finally:
        client.close()

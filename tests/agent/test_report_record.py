"""A node's report is one etcd request, and a steady one reads back a count, not the job's records.

Counted by a private etcd's own metrics (``marind.testing.etcd_metrics``), not timed: the
report's transaction writes the node's record and reads back the count of the job's node
records, the ones created since the last read when one came, and all of them at the first
report (with one read of the node's own record, which an earlier incarnation may have left) and
after the watch broke; a record that went comes from the watch of deletes (made at the first
report), with no read. A record replaced by a new incarnation is deleted first by it, so the
others see the loss at their next report (the periodic full read that found it is gone).
"""

from __future__ import annotations

from marind.agent.membership import Membership, report_record
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_metrics import etcd_counters

PEERS = 40


def test_a_report_is_one_request_and_reads_the_records_only_when_they_change(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/rep")
    ep = etcd_private.endpoint
    mine = {"node": "a", "incarnation": "1", "workers": [{"rank": 0}]}
    members = Membership(client, "j", "a", "1")
    try:
        lease = client.lease(60)
        for i in range(PEERS):
            client.put_json(client.key("jobs", "j", "nodes", f"p{i:02d}"),
                            {"node": f"p{i:02d}", "incarnation": str(i), "padding": "x" * 200})

        def report() -> dict:
            before = etcd_counters(ep)
            report_record(client, "j", "a", mine, lease, members)
            losses = members.poll()
            after = etcd_counters(ep)
            return {"requests": after["requests"] - before["requests"],
                    "bytes_out": after["bytes_out"] - before["bytes_out"], "lost": [x.node for x in losses]}

        first = report()          # the first: its own record, the watch of deletes, the records read back
        assert first == {**first, "requests": 3, "lost": []} and first["bytes_out"] > PEERS * 200
        assert client.lease_of(client.key("jobs", "j", "nodes", "a")) == lease.id
        assert len(members.known) == PEERS + 1
        steady = report()                             # nothing came or went: a count comes back
        assert steady == {**steady, "requests": 1, "lost": []}
        assert steady["bytes_out"] * 10 < first["bytes_out"], (steady, first)

        client.delete(client.key("jobs", "j", "nodes", "p07"))     # p07 goes: seen at the next report
        gone = report()
        # the report (the delete came through the watch, with p07's last record); then the loss's
        # own two reads (its departed claim, its registration)
        assert gone["lost"] == ["p07"] and gone["requests"] == 1 + 2, gone
        assert gone["bytes_out"] < first["bytes_out"] / 4, (gone, first)
        client.put_json(client.key("jobs", "j", "nodes", "p99"), {"node": "p99", "incarnation": "9"})
        came = report()                               # a node came: it alone read back, in the same request
        assert came == {**came, "requests": 1, "lost": []} and "p99" in members.known
        assert came["bytes_out"] < first["bytes_out"] / 4, (came, first)

        p03 = Membership(client, "j", "p03", "33")   # p03's agent restarted (its old record's lease lives on)
        try:
            report_record(client, "j", "p03", {"node": "p03", "incarnation": "33"}, None, p03)
        finally:
            p03.close()
        replaced = report()                           # its first report dropped the old record: a delete
        assert replaced == {**replaced, "lost": ["p03"]} and members.known["p03"] == "33", replaced
        assert replaced["bytes_out"] < first["bytes_out"] / 4, (replaced, first)
        for _ in range(20):                           # and no periodic full read of every record
            assert report()["bytes_out"] * 10 < first["bytes_out"]

        members._deletes(None)                        # the watch's stream ended ...
        client.delete(client.key("jobs", "j", "nodes", "p11"))     # ... and p11 went meanwhile
        back = report()                               # a new watch, and every record read back
        assert back == {**back, "lost": ["p11"]} and back["requests"] == 2 + 2, back
        assert back["bytes_out"] > PEERS * 200, back
        assert members.poll() == []                   # a poll without a report reads the records itself
    finally:
        members.close()
        client.close()

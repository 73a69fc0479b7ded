"""`marind doctor --cluster` on the bed: three hosts, a real `marind agent` in each; all healthy,
then host1's data link cut (the host that would be rank 0): it is named, the other two still measured."""

from __future__ import annotations

import json

import pytest

from marind.cli import main
from marind.core.etcd_client import EtcdClient
from marind.testing.hosts import HostBed
from tests.agent.helpers import agent_log, node_registered, wait_for
from tests.hosts.conftest import require_bed

pytestmark = pytest.mark.hosts

NAMES = ["host1", "host2", "host3"]


@pytest.fixture
def bed3(tmp_path):
    require_bed()
    hb = HostBed(tmp_path / "bed", NAMES).start()
    try:
        yield hb
    finally:
        hb.close()
    assert hb.leftovers() == []


def doctor(capsys) -> tuple[int, dict]:
    rc = main(["doctor", "--cluster", "--json", "--bytes", str(4 << 20), "--timeout", "60"])
    return rc, json.loads(capsys.readouterr().out)


def test_cluster_check_measures_every_host_and_names_the_cut_one(bed3, etcd_prefix, capsys, monkeypatch):
    bed = bed3
    monkeypatch.setenv("MARIND_ETCD", bed.plan.etcd)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    for name in NAMES:
        bed.start_agent(name, etcd_prefix)
    diag = lambda: "\n".join(f"--- {n} ---\n{agent_log(bed.root, n)}" for n in NAMES)
    with EtcdClient(bed.plan.etcd, prefix=etcd_prefix) as client:
        wait_for(lambda: all(node_registered(client, n) for n in NAMES), 60, "three agents registered", diag=diag)

        rc, doc = doctor(capsys)
        assert rc == 0 and doc["ok"] and doc["failing"] == [], f"{doc}\n{diag()}"
        assert [h["node"] for h in doc["hosts"]] == NAMES and doc["world_size"] == 3 and doc["backend"] == "gloo"
        for row in doc["hosts"]:
            assert row["host"] == row["node"] and row["reachable_from"] == 2 and row["error"] is None, row
            assert row["latency_s"] > 0 and row["bus_bandwidth"] > 0, row

        bed.cut("host1", "data")
        rc, doc = doctor(capsys)
        assert rc == 1 and not doc["ok"] and doc["failing"] == ["host1"], f"{doc}\n{diag()}"
        rows = {h["node"]: h for h in doc["hosts"]}
        assert rows["host1"]["reachable_from"] == 0 and "not reachable from host2" in rows["host1"]["error"]
        assert doc["world_size"] == 2
        for node, rank in (("host2", 0), ("host3", 1)):
            row = rows[node]
            assert row["error"] is None and row["rank"] == rank and row["reachable_from"] == 1, row
            assert row["latency_s"] > 0 and row["bus_bandwidth"] > 0, row
        # nothing of either check is left in etcd; the agents kept no probe running
        assert client.get_prefix_keys(client.key("doctor") + "/") == []
    for name in NAMES:
        assert "doctor_probe_started" in agent_log(bed.root, name)

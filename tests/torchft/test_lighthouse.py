"""Lighthouse election and replica-group slots on a real etcd (marind/agent/ft/coordinator.py).

Each coordinator stands for one node's agent: its own etcd lease (the node's), its
own run dir. Losing a node = its lease revoked (what expiry does) and its processes
killed; the survivor's next tick elects a new lighthouse with a higher epoch.
"""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("torchft")

from marind.agent.ft.coordinator import FTCoordinator
from marind.control.ft_status import ft_status
from marind.core.netutil import port_open

SPEC = {"fault": {"mode": "torchft", "replica_groups": 2, "min_replicas": 1,
                  "join_timeout": 0.5, "heartbeat_timeout": 2.0}}


class Node:
    def __init__(self, client, name, tmp_path):
        self.client, self.name = client, name
        self.lease = client.lease(30)
        self.ft = FTCoordinator(client, "job1", name, "127.0.0.1", SPEC, tmp_path / name, lease=lambda: self.lease)

    def published(self) -> dict:
        return json.loads((self.ft.run_dir / "ft" / "lighthouse.json").read_text())

    def die(self) -> None:
        """The node is gone: its processes die and its lease expires."""
        if self.ft.proc is not None and self.ft.proc.proc is not None:
            self.ft.proc.proc.send_signal(signal.SIGKILL)
            self.ft.proc.proc.wait(5)
        self.client.revoke_lease(self.lease)


@pytest.fixture
def nodes(etcd_client, tmp_path):
    made = [Node(etcd_client, f"n{i}", tmp_path) for i in range(3)]
    yield made
    for n in made:
        n.ft.stop(release=False)


def test_one_lighthouse_slots_and_published_address(nodes):
    a, b, c = nodes
    a.ft.tick()
    b.ft.tick()
    c.ft.tick()
    assert (a.ft.slot, b.ft.slot, c.ft.slot) == (0, 1, None)       # replica_groups = 2
    assert a.ft.ready and b.ft.ready and not c.ft.ready
    assert a.ft.holds_lighthouse and not b.ft.holds_lighthouse and b.ft.proc is None
    pub_a, pub_b = a.published(), b.published()
    assert pub_a == pub_b and pub_a["node"] == "n0"
    port = int(pub_a["address"].rsplit(":", 1)[1])
    assert port_open("127.0.0.1", port)
    assert b.ft.worker_env() == {"MARIND_REPLICA_GROUP": "1", "TORCHFT_LIGHTHOUSE": pub_a["address"]}
    st = ft_status(a.client, "job1")
    assert [g["node"] for g in st["groups"]] == ["n0", "n1"] and st["lighthouse"]["node"] == "n0"
    a.ft.tick()                                                      # stable: same slot, same epoch
    assert a.ft.slot == 0 and a.published()["epoch"] == pub_a["epoch"]


def test_losing_the_lighthouse_node_elects_another(nodes):
    a, b, _ = nodes
    a.ft.tick()
    b.ft.tick()
    old = b.published()
    a.die()
    b.ft.tick()
    new = b.published()
    assert new["node"] == "n1" and new["epoch"] > old["epoch"] and new["address"] != old["address"]
    assert b.ft.holds_lighthouse
    assert port_open("127.0.0.1", int(new["address"].rsplit(":", 1)[1]))


def test_dead_lighthouse_process_is_replaced_with_a_new_epoch(nodes):
    a, b, _ = nodes
    a.ft.tick()
    b.ft.tick()
    old = a.published()
    a.ft.proc.proc.send_signal(signal.SIGKILL)
    a.ft.proc.proc.wait(5)
    a.ft.tick()                       # the holder notices and runs again; b may win on its next tick
    b.ft.tick()
    a.ft.tick()
    new = b.published()
    assert new["epoch"] > old["epoch"] and a.published() == new
    holders = [n for n in (a, b) if n.ft.holds_lighthouse]
    assert len(holders) == 1 and holders[0].name == new["node"]


def test_release_on_stop_frees_slot_and_lighthouse(nodes):
    a, b, _ = nodes
    a.ft.tick()
    a.ft.stop()
    b.ft.tick()
    assert b.ft.slot == 0 and b.ft.holds_lighthouse


def test_groups_of_two_nodes_fill_in_order_and_a_spare_takes_a_dead_members_place(etcd_client, tmp_path):
    spec = {"fault": dict(SPEC["fault"], nodes_per_group=2)}
    made = []
    try:
        for i in range(5):
            n = Node(etcd_client, f"m{i}", tmp_path)
            n.ft = FTCoordinator(etcd_client, "job2", n.name, "127.0.0.1", spec, tmp_path / n.name,
                                 lease=lambda n=n: n.lease)
            made.append(n)
        for n in made:
            n.ft.tick()
        assert [(n.ft.slot, n.ft.member) for n in made] == [(0, 0), (0, 1), (1, 0), (1, 1), (None, None)]
        assert made[3].ft.worker_env()["MARIND_REPLICA_GROUP"] == "1"
        st = ft_status(etcd_client, "job2")
        assert [(g["slot"], g["member"], g["node"]) for g in st["groups"]] == [
            (0, 0, "m0"), (0, 1, "m1"), (1, 0, "m2"), (1, 1, "m3")]
        made[2].die()                       # a member of group 1 goes: the spare completes group 1
        made[4].ft.tick()
        assert (made[4].ft.slot, made[4].ft.member) == (1, 0) and made[4].ft.ready
        made[3].ft.tick()
        assert (made[3].ft.slot, made[3].ft.member) == (1, 1)    # the survivor keeps its place
    finally:
        for n in made:
            n.ft.stop(release=False)

"""The bed's nftables filters as text: which host's table drops what (pure; no nft, no namespace)."""

from __future__ import annotations

import pytest

from marind.testing.hosts_filter import Rule, check_percent, lossy_rules, one_way_rules, render_table
from marind.testing.hosts_plan import plan_bed

pytestmark = pytest.mark.unit


@pytest.fixture
def plan():
    return plan_bed(["host1", "host2", "host3"], "abc123", ("10.40.10.0/24", "10.40.11.0/24"))


def test_one_way_drop_is_a_rule_at_the_receiver(plan):
    rules = one_way_rules(plan, "host1", "host2", "data")
    assert rules == [Rule(host="host2", ifname="data0", saddr="10.40.11.11", percent=100,
                          fault="one-way host1->host2 data")]
    both = one_way_rules(plan, "host2", "host1", "both")
    assert [(r.host, r.ifname, r.saddr) for r in both] == [("host1", "ctl0", "10.40.10.12"),
                                                           ("host1", "data0", "10.40.11.12")]
    with pytest.raises(ValueError):
        one_way_rules(plan, "host1", "host1", "data")
    with pytest.raises(KeyError):
        one_way_rules(plan, "host1", "nohost", "data")


def test_a_lossy_link_drops_at_its_own_ingress_and_at_every_peer_s_for_its_packets(plan):
    rules = lossy_rules(plan, "host2", "data", 25)
    assert [(r.host, r.saddr, r.percent) for r in rules] == [("host2", None, 25), ("host1", "10.40.11.12", 25),
                                                             ("host3", "10.40.11.12", 25)]
    assert {r.ifname for r in rules} == {"data0"}


def test_render_replaces_the_table_atomically_one_chain_per_interface(plan):
    rules = [*one_way_rules(plan, "host1", "host2", "both"),
             Rule(host="host2", ifname="data0", saddr=None, percent=30, fault="lossy host2 data 30%")]
    text = render_table(rules)
    lines = text.splitlines()
    assert lines[:2] == ["add table netdev marind_bed", "delete table netdev marind_bed"]
    assert 'type filter hook ingress device "ctl0" priority -500; policy accept;' in text
    assert 'ip saddr 10.40.11.11 drop comment "one-way host1->host2 data"' in text
    assert 'meta protocol ip numgen random mod 100 < 30 drop comment "lossy host2 data 30%"' in text
    assert text.count("chain in_") == 2
    assert render_table([]) == "add table netdev marind_bed\ndelete table netdev marind_bed\n"


@pytest.mark.parametrize("bad", [0, 101, 12.5, -3])
def test_loss_is_a_whole_percentage(bad):
    with pytest.raises(ValueError):
        check_percent(bad)
    assert check_percent(100) == 100 and check_percent(25.0) == 25

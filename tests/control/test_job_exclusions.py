"""Which node a job's stragglers take out of it (pure), and the exclusion key against a real etcd."""

from __future__ import annotations

import pytest

from marind.control.job_exclusions import exclude, excluded_nodes, exclusion_decision, exclusion_of


@pytest.mark.unit
def test_the_slowest_stragglers_node_goes_when_the_job_keeps_its_minimum():
    d = exclusion_decision({"c/2": 0.9, "b/1": 0.6}, ["a", "b", "c"], min_nodes=2)
    assert d.node == "c" and "node c taken out" in d.reason and "2 node(s) go on" in d.reason
    d = exclusion_decision({"c/2": 0.9, "b/1": 0.6}, ["a", "b", "c"], min_nodes=2, excluded={"c"})
    assert d.node is None and "under its minimum of 2" in d.reason        # b would leave a alone
    assert exclusion_decision({"b/1": 0.5, "c/4": 0.5}, ["a", "b", "c"], min_nodes=1).node == "b"   # a tie: by name


@pytest.mark.unit
def test_no_exclusion_below_the_minimum_or_for_a_node_not_in_the_job():
    d = exclusion_decision({"b/1": 0.9}, ["a", "b"], min_nodes=2)
    assert d.node is None and "1 node(s), under its minimum of 2 (job.nodes)" in d.reason
    assert exclusion_decision({"z/0": 0.9}, ["a", "b", "c"], min_nodes=1).node is None
    assert exclusion_decision({}, ["a", "b"], min_nodes=1).reason == "no straggler on a node of the job"


def test_an_exclusion_is_written_once_and_read_back(etcd_client):
    assert exclude(etcd_client, "j1", "c", {"reason": "slow"}, by="a")
    assert not exclude(etcd_client, "j1", "c", {"reason": "again"}, by="b")   # the first one stands
    doc = exclusion_of(etcd_client, "j1", "c")
    assert doc is not None and doc["reason"] == "slow" and doc["by"] == "a"
    assert exclusion_of(etcd_client, "j1", "a") is None
    assert list(excluded_nodes(etcd_client, "j1")) == ["c"]

"""The memory tier's placement math: who keeps whose replica, what a loss of nodes leaves."""

from __future__ import annotations

import itertools

import pytest

from ckpt_store.memory.ring import (
    holders,
    lost_parts,
    memory_fits,
    memory_needed,
    node_order,
    replica_target,
    survives,
)

pytestmark = pytest.mark.unit


def test_nodes_are_ordered_by_their_lowest_rank():
    assert node_order(["b", "b", "a", "a", "c"]) == ["b", "a", "c"]
    assert node_order([]) == []


def test_each_node_replicates_to_the_next_around_the_ring():
    assert [replica_target(i, 4) for i in range(4)] == [1, 2, 3, 0]
    assert replica_target(0, 1) is None
    assert holders(3, 4) == {3, 0}
    assert holders(0, 1) == {0}
    with pytest.raises(ValueError, match="not in a world of 2"):
        replica_target(2, 2)


def test_every_node_is_replicated_exactly_once_elsewhere():
    for n in range(2, 7):
        kept = [replica_target(i, n) for i in range(n)]
        assert sorted(kept) == list(range(n))          # each node holds one replica
        assert all(k != i for i, k in enumerate(kept))  # never its own


def test_one_lost_node_never_loses_a_step():
    for n in range(2, 7):
        for lost in range(n):
            ok, why = survives(n, [lost])
            assert ok, why
            assert lost_parts(n, [lost]) == []


def test_a_replica_pair_lost_together_loses_the_step_and_names_the_pair():
    ok, why = survives(3, [1, 2])
    assert not ok
    assert "pairs 1+2" in why
    assert lost_parts(3, [1, 2]) == [1]
    ok, why = survives(4, [0, 2])       # not a pair: 0's replica is on 1, 2's on 3
    assert ok, why


def test_survival_matches_a_brute_force_over_every_loss():
    for n in range(1, 6):
        for k in range(n + 1):
            for lost in itertools.combinations(range(n), k):
                whole = all(any(h not in lost for h in ({i, (i + 1) % n})) for i in range(n))
                assert survives(n, lost)[0] == whole, (n, lost)


def test_losing_every_node_or_the_only_node_loses_everything():
    assert survives(1, [0]) == (False, "every node of 1 lost")
    assert not survives(2, [0, 1])[0]
    assert survives(2, [])[0]


def test_memory_needed_counts_own_and_replica_for_kept_and_in_flight_steps():
    assert memory_needed(100, 40, kept=1) == 280
    assert memory_needed(100, 0, kept=2) == 300


def test_memory_fit_says_the_figures():
    ok, why = memory_fits(3 << 30, 10 << 30)
    assert ok and "needs 3.00 GiB" in why
    ok, why = memory_fits(10 << 30, 10 << 30)
    assert not ok
    assert "needs 10.00 GiB" in why and "has 10.00 GiB available" in why and "9.00 GiB after" in why

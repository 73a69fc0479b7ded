"""Unit tests of the data-network verdicts (``marind.agent.liveness.data_decisions``): no process, no etcd."""

from __future__ import annotations

import pytest

from marind.agent.liveness.data_decisions import (
    DataAction,
    ReachRow,
    commit_fence_due,
    cut_off,
    on_data_loss,
)

pytestmark = pytest.mark.unit
NOW, WINDOW, FRESH = 1000.0, 5.0, 10.0


def row(node: str, peers: list[str], down: dict[str, float] | None = None, *, link_up: bool = True,
        at: float = NOW) -> ReachRow:
    return ReachRow(node=node, at=at, link_up=link_up, probed=frozenset(peers), down=down or {})


def verdict(*rows: ReachRow) -> frozenset[str]:
    return cut_off({r.node: r for r in rows}, now=NOW, window=WINDOW, fresh_s=FRESH)[0]


def test_everyone_reaching_everyone_cuts_nobody():
    assert verdict(row("a", ["b", "c"]), row("b", ["a", "c"]), row("c", ["a", "b"])) == frozenset()


def test_majority_names_the_node_that_reaches_nobody():
    long_ago = NOW - WINDOW - 1
    rows = (row("a", ["b", "c"], {"b": long_ago, "c": long_ago}),
            row("b", ["a", "c"], {"a": long_ago}), row("c", ["a", "b"], {"a": long_ago}))
    assert verdict(*rows) == frozenset({"a"})


def test_silence_shorter_than_the_window_decides_nothing():
    recent = NOW - WINDOW + 1
    rows = (row("a", ["b", "c"], {"b": recent, "c": recent}),
            row("b", ["a", "c"], {"a": recent}), row("c", ["a", "b"], {"a": recent}))
    assert verdict(*rows) == frozenset()


def test_two_nodes_are_told_apart_by_their_own_link():
    long_ago = NOW - WINDOW - 1
    a = row("a", ["b"], {"b": long_ago}, link_up=False)
    b = row("b", ["a"], {"a": long_ago})
    assert verdict(a, b) == frozenset({"a"})


def test_when_no_side_can_tell_the_first_node_keeps_the_job():
    """Both links keep their carrier (a switch dropping traffic), or both lost it: a world of one node
    needs no data network, so the first by name trains on and the other is cut off (it fences, holds,
    and rejoins once a peer answers) instead of both waiting for hang_timeout."""
    long_ago = NOW - WINDOW - 1
    a, b = row("a", ["b"], {"b": long_ago}), row("b", ["a"], {"a": long_ago})
    cut, why = cut_off({"a": a, "b": b}, now=NOW, window=WINDOW, fresh_s=FRESH)
    assert cut == frozenset({"b"}) and "keeps its carrier" in why and "a (first by name) keeps" in why
    a_down, b_down = (row(n, [p], {p: long_ago}, link_up=False) for n, p in (("a", "b"), ("b", "a")))
    cut, why = cut_off({"a": a_down, "b": b_down}, now=NOW, window=WINDOW, fresh_s=FRESH)
    assert cut == frozenset({"b"}) and "lost its carrier" in why
    rows = {n: row(n, [p for p in "abc" if p != n], {p: long_ago for p in "abc" if p != n}) for n in "abc"}
    assert cut_off(rows, now=NOW, window=WINDOW, fresh_s=FRESH)[0] == frozenset({"b", "c"})   # the switch died
    recent = NOW - WINDOW + 1
    young = {"a": row("a", ["b"], {"b": recent}), "b": row("b", ["a"], {"a": recent})}
    assert cut_off(young, now=NOW, window=WINDOW, fresh_s=FRESH)[0] == frozenset()       # not for long enough


def test_an_asymmetric_silence_between_isolated_nodes_decides_nothing():
    long_ago = NOW - WINDOW - 1
    a = row("a", ["b"], {"b": long_ago})
    b = row("b", ["a"])                      # b still reaches a; a reaches nobody
    cut, why = cut_off({"a": a, "b": b}, now=NOW, window=WINDOW, fresh_s=FRESH)
    assert cut == frozenset()


def test_a_node_still_reached_by_a_peer_is_not_cut_off():
    long_ago = NOW - WINDOW - 1
    rows = (row("a", ["b", "c"], {"b": long_ago, "c": long_ago}),
            row("b", ["a", "c"], {"a": long_ago}), row("c", ["a", "b"]))      # c still reaches a
    assert verdict(*rows) == frozenset()


def test_stale_rows_have_no_say():
    long_ago = NOW - WINDOW - 1
    a = row("a", ["b"], {"b": long_ago}, link_up=False)
    b = row("b", ["a"], {"a": long_ago}, at=NOW - FRESH - 1)
    assert verdict(a, b) == frozenset()


def test_a_row_without_data_or_malformed_is_none():
    assert ReachRow.from_data("a", None) is None
    assert ReachRow.from_data("a", {"at": "x"}) is None
    assert ReachRow.from_data("a", {"probed": ["b"]}, at=9.0).at == 9.0      # the key's presence as its time
    parsed = ReachRow.from_data("a", {"at": 5, "link_up": False, "probed": ["b"], "down": {"b": 1}})
    assert parsed == ReachRow("a", 5.0, False, frozenset({"b"}), {"b": 1.0})


def decide(**kw):
    args = dict(me="b", cut=frozenset({"a"}), acted=frozenset(), in_round=frozenset({"a"}), workers_running=True,
                progress_at=NOW - WINDOW - 1, now=NOW, stall_s=WINDOW)
    args.update(kw)
    return on_data_loss(**args)


def test_survivor_with_stalled_workers_restarts_without_the_cut_node():
    action, nodes, _ = decide()
    assert action == DataAction.RESTART and nodes == frozenset({"a"})


def test_survivor_still_stepping_waits():
    assert decide(progress_at=NOW - 1)[0] == DataAction.WAIT


def test_survivor_not_in_a_round_with_it_only_marks():
    assert decide(in_round=frozenset())[0] == DataAction.MARK
    assert decide(workers_running=False)[0] == DataAction.MARK


def test_the_cut_node_fences_itself_once_its_workers_stalled():
    assert decide(me="a")[0] == DataAction.FENCE
    assert decide(me="a", progress_at=NOW - 1)[0] == DataAction.WAIT
    assert decide(me="a", workers_running=False)[0] == DataAction.FENCE


def test_acted_on_does_nothing():
    assert decide(acted=frozenset({"a"}))[0] == DataAction.NONE
    assert decide(cut=frozenset())[0] == DataAction.NONE


def test_torchft_survivors_only_record_and_the_cut_group_fences_even_while_it_steps():
    """A torchft group restarts for nobody: its quorum drops the cut-off group. The cut-off node's
    group stops at once, stepping or not (alone, or holding the lighthouse, it would train apart)."""
    assert decide(torchft=True)[:2] == (DataAction.MARK, frozenset({"a"}))
    assert decide(torchft=True, progress_at=NOW - 1)[0] == DataAction.MARK        # no wait, no restart
    assert decide(torchft=True, acted=frozenset({"a"}))[0] == DataAction.NONE
    assert decide(torchft=True, cut=frozenset())[0] == DataAction.NONE
    for progress_at in (None, NOW - 1, NOW - 100):
        assert decide(torchft=True, me="a", progress_at=progress_at)[:2] == (DataAction.FENCE, frozenset({"a"}))


def test_commit_fence_after_every_peer_silent_for_a_while():
    probed = frozenset({"b", "c"})
    assert commit_fence_due({}, probed, NOW) is None
    assert commit_fence_due({"b": NOW - 5}, probed, NOW) is None            # c answers
    assert commit_fence_due({"b": NOW - 5, "c": NOW - 1}, probed, NOW) is None   # not long enough
    assert commit_fence_due({"b": NOW - 5, "c": NOW - 3}, probed, NOW) == NOW - 3
    assert commit_fence_due({}, frozenset(), NOW) is None                   # no peer: nothing to fence


def test_no_fence_once_every_other_node_is_dead_and_only_then():
    probed, down = frozenset({"b", "c"}), {"b": NOW - 5, "c": NOW - 3}
    everyone = frozenset({"b", "c"})
    assert commit_fence_due(down, probed, NOW, dead=frozenset({"b"}), others=everyone) == NOW - 3   # c may live
    assert commit_fence_due(down, probed, NOW, dead=everyone, others=everyone) is None              # no one left
    # its ring targets dead (with its own switch, say) while a node it does not probe lives: still fenced
    assert commit_fence_due(down, probed, NOW, dead=everyone, others=everyone | {"d"}) == NOW - 3
    # the torchft survivor of its only peer's power-off
    assert commit_fence_due({"b": NOW - 5}, frozenset({"b"}), NOW, dead=frozenset({"b"}),
                            others=frozenset({"b"})) is None


def test_each_node_probes_a_few_peers_and_is_probed_by_as_many():
    from collections import Counter

    from marind.agent.liveness.data_decisions import PROBE_FANOUT, probe_targets
    assert probe_targets("j", "a", {"a", "b", "c"}) == frozenset({"b", "c"})          # small jobs: everyone
    assert probe_targets("j", "a", {"b", "c"}) == frozenset({"b", "c"})
    nodes = {f"node{i:04d}" for i in range(1000)}
    targets = {n: probe_targets("job-1", n, nodes) for n in nodes}
    assert all(len(t) == PROBE_FANOUT and n not in t for n, t in targets.items())
    probed_by = Counter(p for t in targets.values() for p in t)
    assert set(probed_by.values()) == {PROBE_FANOUT}                                    # a ring: no node unwatched
    assert targets == {n: probe_targets("job-1", n, nodes) for n in nodes}              # every agent agrees
    neighbours = sum(1 for n, t in targets.items() for p in t if abs(int(p[4:]) - int(n[4:])) == 1)
    assert neighbours < 50                                   # not by name: one rack does not watch only itself
    assert probe_targets("job-2", "node0000", nodes) != targets["node0000"]


def test_a_probe_ring_hashes_again_only_when_the_nodes_change(monkeypatch):
    from marind.agent.liveness import data_decisions as dd
    calls = []
    real = dd.probe_targets
    monkeypatch.setattr(dd, "probe_targets", lambda *a, **k: calls.append(a) or real(*a, **k))
    ring = dd.ProbeRing("job-1", "n0")
    nodes = frozenset(f"n{i}" for i in range(10))
    first = ring.targets(nodes)
    assert first == real("job-1", "n0", nodes) and ring.targets(frozenset(nodes)) == first and len(calls) == 1
    fewer = nodes - first
    assert ring.targets(fewer) == real("job-1", "n0", fewer) != first and len(calls) == 2


def test_a_ring_verdict_cuts_off_a_node_its_probers_lost():
    """Five nodes, each probing three: d's link dies, so d reaches none of the three it probes and the
    three that probe it all have it down; the others still reach peers."""
    from marind.agent.liveness.data_decisions import probe_targets
    nodes = {"a", "b", "c", "d", "e"}
    long_ago = NOW - WINDOW - 1
    rows = {}
    for n in nodes:
        probed = sorted(probe_targets("j", n, nodes))
        down = {p: long_ago for p in probed if n == "d" or p == "d"}
        rows[n] = row(n, probed, down, link_up=n != "d")
    assert cut_off(rows, now=NOW, window=WINDOW, fresh_s=FRESH)[0] == frozenset({"d"})


def test_a_broken_pair_among_three_cuts_the_later_of_the_two():
    """a's packets to b vanish (a one-way drop: TCP fails both ways); both still reach c. Nobody is isolated,
    but the workers' collectives need the pair: b (the later by name) is cut off, a and c keep the job."""
    long_ago = NOW - WINDOW - 1
    rows = {"a": row("a", ["b", "c"], {"b": long_ago}), "b": row("b", ["a", "c"], {"a": long_ago}),
            "c": row("c", ["a", "b"])}
    cut, why = cut_off(rows, now=NOW, window=WINDOW, fresh_s=FRESH)
    assert cut == frozenset({"b"}) and "a-b" in why
    recent = NOW - WINDOW + 1
    young = {**rows, "a": row("a", ["b", "c"], {"b": recent})}
    assert cut_off(young, now=NOW, window=WINDOW, fresh_s=FRESH)[0] == frozenset()       # not for long enough


def test_a_pair_silent_one_way_only_is_not_broken():
    long_ago = NOW - WINDOW - 1
    rows = {"a": row("a", ["b", "c"], {"b": long_ago}), "b": row("b", ["a", "c"]), "c": row("c", ["a", "b"])}
    assert cut_off(rows, now=NOW, window=WINDOW, fresh_s=FRESH)[0] == frozenset()


def test_the_fewest_nodes_that_leave_no_broken_pair_are_cut():
    from marind.agent.liveness.data_decisions import broken_pairs, fewest_to_cut
    assert fewest_to_cut([("a", "b")]) == frozenset({"b"})
    assert fewest_to_cut([("a", "c"), ("b", "c"), ("c", "d")]) == frozenset({"c"})      # the one in most pairs
    assert fewest_to_cut([("a", "b"), ("c", "d")]) == frozenset({"b", "d"})
    assert fewest_to_cut([]) == frozenset()
    long_ago = NOW - WINDOW - 1
    rows = {"a": row("a", ["b"], {"b": long_ago}), "b": row("b", ["c"]), "c": row("c", ["a"])}   # a ring
    assert broken_pairs(rows, now=NOW, window=WINDOW) == [("a", "b")]       # b does not probe a: a's word holds


def test_a_node_cut_off_for_a_broken_pair_must_hear_from_its_partner_before_it_rejoins():
    from marind.agent.liveness.data_decisions import must_answer
    long_ago = NOW - WINDOW - 1
    assert must_answer(row("b", ["a", "c"], {"a": long_ago}), {"a", "c"}) == frozenset({"a"})
    assert must_answer(row("b", ["a", "c"], {"a": long_ago, "c": long_ago}), {"a", "c"}) == frozenset()  # isolated
    assert must_answer(row("b", ["a"], {"a": long_ago}), {"a"}) == frozenset()
    assert must_answer(None, {"a"}) == frozenset()

"""The trainer's memory-checkpoint decisions: where a restart restores from, whether a host has the memory."""

from __future__ import annotations

import pytest

from marind.trainer.memory_ckpt import memory_plan, pick_restore, run_name

pytestmark = pytest.mark.unit


def test_a_whole_memory_step_newer_than_the_durable_one_is_restored():
    pick = pick_restore([(9, True, "ok"), (8, True, "ok")], durable=5)
    assert (pick.source, pick.step, pick.fallback) == ("memory", 9, False)


def test_a_tie_goes_to_memory_and_an_older_memory_step_to_the_durable_store():
    assert pick_restore([(5, True, "ok")], durable=5).source == "memory"
    pick = pick_restore([(4, True, "ok")], durable=5)
    assert (pick.source, pick.step, pick.fallback) == ("durable", 5, False)


def test_a_lost_newer_memory_step_falls_back_to_the_durable_one_and_says_why():
    pick = pick_restore([(9, False, "3 objects on no live node"), (4, True, "ok")], durable=5)
    assert (pick.source, pick.step, pick.fallback) == ("durable", 5, True)
    assert "memory step 9 cannot be restored (3 objects on no live node)" in pick.reason
    assert "falling back to durable step 5" in pick.reason
    assert pick.lost_step == 9 and pick.record()["fallback"] is True


def test_a_lost_memory_step_older_than_the_durable_one_is_no_fallback():
    pick = pick_restore([(4, False, "lost")], durable=5)
    assert (pick.source, pick.step, pick.fallback) == ("durable", 5, False)


def test_a_lost_newest_with_an_older_whole_memory_step_and_no_durable_store():
    pick = pick_restore([(9, False, "lost"), (8, True, "ok")], durable=None)
    assert (pick.source, pick.step, pick.fallback) == ("memory", 8, False)   # 8 is whole: restored
    pick = pick_restore([(9, False, "lost")], durable=None)
    assert (pick.source, pick.step, pick.fallback) == ("none", None, True)
    assert pick_restore([], None) == pick_restore([], None)
    assert pick_restore([], None).source == "none"


def test_memory_plan_counts_own_and_the_previous_hosts_replica():
    per_host = {"a": 4 << 30, "b": 1 << 30}
    ok, why = memory_plan(1, per_host, ["a", "b"], "b", available=20 << 30)
    assert ok, why        # b: (1 + 4) GiB x 2 = 10 GiB of 18 usable
    ok, why = memory_plan(1, per_host, ["a", "b"], "b", available=10 << 30)
    assert not ok
    assert why.startswith("checkpoint.memory_every = 1 on host b: needs 10.00 GiB")
    ok, _ = memory_plan(1, {"a": 4 << 30}, ["a"], "a", available=9 << 30)
    assert ok             # one host: no replica, (4 + 0) x 2 = 8 GiB


def test_run_names_are_safe_and_tied_to_the_durable_store():
    assert run_name("job/1", "file:///x") != run_name("job/1", "file:///y")
    assert "/" not in run_name("job/1", "file:///x")

"""The scheduler: a pure, seeded schedule, and a real run that waits what it drew."""

from __future__ import annotations

import json
import statistics

import pytest

from marind.testing.chaos.schedule import Draw, draw_schedule
from tests.chaos.conftest import run_injector


@pytest.mark.unit
def test_same_seed_same_schedule_and_bounds():
    a = draw_schedule(7, every=60, duration=3600)
    assert a == draw_schedule(7, every=60, duration=3600)
    assert a != draw_schedule(8, every=60, duration=3600)
    assert all(0 < d.at <= 3600 for d in a)
    assert [d.index for d in a] == list(range(len(a)))
    assert all(x.at < y.at for x, y in zip(a, a[1:]))
    assert len(draw_schedule(7, every=60, duration=3600, max_actions=3)) == 3
    assert draw_schedule(7, every=60, duration=0) == []


@pytest.mark.unit
def test_exponential_gaps_have_the_requested_mean():
    draws = draw_schedule(1, every=10, duration=100_000)
    gaps = [y.at - x.at for x, y in zip(draws, draws[1:])]
    assert 9.0 < statistics.mean(gaps) < 11.0
    assert min(gaps) < 1.0 < 30.0 < max(gaps), "exponential, not fixed"


@pytest.mark.unit
def test_fixed_and_min_gap():
    assert [d.at for d in draw_schedule(3, every=5, duration=20, fixed=True)] == [5, 10, 15, 20]
    draws = draw_schedule(3, every=1, duration=1000, min_gap=2.5)
    assert all(y.at - x.at >= 2.5 - 1e-6 for x, y in zip(draws, draws[1:]))
    with pytest.raises(ValueError, match="--every"):
        draw_schedule(1, every=0, duration=10)


def test_schedule_runs_the_injector_at_the_drawn_times(etcd, etcd_prefix, fake_node):
    a = fake_node("job-s", "n1", 2)
    res = run_injector("schedule", "--job", "job-s", "--seed", "5", "--every", "0.7",
                       "--duration", "30", "--max-actions", "2", "kill_random_rank",
                       "--", "--signal", "CONT", etcd=etcd, prefix=etcd_prefix, timeout=90)
    assert res.returncode == 0, res.stderr
    assert [ln["draw"] for ln in res.lines] == [0, 1]
    assert all(ln["action"] == "kill" and ln["signal"] == "SIGCONT" for ln in res.lines)
    schedule = next(json.loads(x) for x in res.stderr.splitlines() if '"schedule"' in x)
    drawn = [Draw(**d) for d in schedule["draws"]]
    assert drawn == draw_schedule(5, every=0.7, duration=30, max_actions=2)
    for line, draw in zip(res.lines, drawn):
        assert line["seed"] == draw.seed
        assert line["at"] >= schedule["start"] + draw.at - 0.01, "it must wait what it drew"
    assert all(a.alive(p) for p in a.workers)


def test_schedule_with_nothing_to_act_on_and_bad_injector(etcd, etcd_prefix):
    res = run_injector("schedule", "--job", "nope", "--every", "0.2", "--fixed",
                       "--max-actions", "1", "kill_random_rank", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 1 and res.lines == []
    res = run_injector("schedule", "--every", "1", "no_such_injector")
    assert res.returncode == 2 and "unknown injector" in res.stderr

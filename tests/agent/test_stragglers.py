"""Stragglers: the pure decision, the per-node sample window, and the watch against a real etcd
(two nodes' summaries, the decider's events, ``{p}/jobs/{job}/stragglers`` and the metric)."""

from __future__ import annotations

import pytest

from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.progress import ProgressRecord
from marind.agent.stragglers import ComputeWindow, RankCompute, StragglerWatch, decide_stragglers
from marind.control.events import list_events
from marind.control.job_exclusions import excluded_nodes

W = 30.0


def _c(median, samples=20, watched=W):
    return RankCompute(median, samples, watched)


@pytest.mark.unit
@pytest.mark.parametrize(("ranks", "named"), [
    ({"a/0": _c(0.1), "b/0": _c(0.1)}, set()),
    ({"a/0": _c(0.1), "b/0": _c(0.3)}, {"b/0"}),                        # two ranks: the slow one vs the other
    ({"a/0": _c(0.1), "a/1": _c(0.11), "b/0": _c(0.1), "b/1": _c(0.3)}, {"b/1"}),
    ({"a/0": _c(0.1), "b/0": _c(0.14)}, set()),                          # within 1.5x
    ({"a/0": _c(0.1), "b/0": _c(0.3, watched=W - 1)}, set()),           # not watched for a whole window
    ({"a/0": _c(0.1), "b/0": _c(0.3, samples=2)}, set()),               # too few samples
    ({"a/0": _c(0.1), "a/1": _c(0.1), "b/0": _c(0.3), "b/1": _c(0.3), "c/0": _c(0.1)}, {"b/0", "b/1"}),
    ({"a/0": _c(0.0), "b/0": _c(0.0)}, set()),
])
def test_decide_stragglers(ranks, named):
    d = decide_stragglers(ranks, factor=1.5, window=W)
    assert set(d.stragglers) == named, d
    assert d.reason
    if named:
        assert sorted(named)[0] in d.reason and "x the others' median" in d.reason


def _rec(rank, step, compute_s, pid=100, group=None):
    return ProgressRecord(rank=rank, local_rank=rank, world_size=2, pid=pid, step=step, loss=1.0, tokens_per_s=1.0,
                          last_checkpoint_step=None, phase="training", updated_at=0.0, replica_group=group,
                          compute_s=compute_s)


@pytest.mark.unit
def test_compute_window_samples_new_steps_and_forgets_a_replaced_worker():
    w = ComputeWindow(10.0)
    for t in range(12):
        w.observe([_rec(0, t, 0.1), _rec(1, t // 2, 0.3)], float(t))    # rank 1's record moves every other tick
    s = w.summary(11.0)
    assert s[0].samples == 11 and s[0].median_s == 0.1 and s[0].watched_s == 11.0   # one aged out
    assert s[1].samples == 5 and s[1].median_s == 0.3                  # t = 2, 4, .., 10
    w.observe([_rec(1, 7, 0.2, pid=101)], 12.0)                        # a new worker on rank 1
    assert w.summary(12.0)[1].samples == 1 and w.summary(12.0)[1].watched_s == 0.0


def test_watch_names_a_slow_node_in_events_status_key_and_metrics(etcd_client):
    job = "strag-1"
    metrics = Metrics()
    boxes = {n: Outbox(etcd_client, n, online=lambda: True, offline=lambda: None) for n in ("na", "nb")}
    watches = {n: StragglerWatch(job, boxes[n], metrics, factor=1.5, window=10.0) for n in boxes}
    for t in range(0, 40):
        now = 1000.0 + t
        # na runs rank 0 (the decider); nb's rank is 3x slower from t = 0 on
        watches["nb"].tick([_rec(1, t, 0.3)], now)
        watches["na"].tick([_rec(0, t, 0.1)], now)
    kinds = [(e["kind"], e["detail"].get("node")) for e in list_events(etcd_client, job)]
    assert kinds == [("straggler", "nb")], kinds
    doc = etcd_client.get_json(etcd_client.key("jobs", job, "stragglers"))
    assert [(r["node"], r["rank"]) for r in doc["ranks"]] == [("nb", 1)] and "3.0x" in doc["reason"], doc
    assert metrics.value("marind_job_stragglers", job=job) == 1
    assert "marind_job_compute_seconds" in metrics.render()
    for t in range(40, 70):          # nb recovers
        now = 1000.0 + t
        watches["nb"].tick([_rec(1, t, 0.1)], now)
        watches["na"].tick([_rec(0, t, 0.1)], now)
    kinds = [e["kind"] for e in list_events(etcd_client, job)]
    assert kinds == ["straggler", "straggler_cleared"], kinds
    assert etcd_client.get_json(etcd_client.key("jobs", job, "stragglers"))["ranks"] == []
    assert metrics.value("marind_job_stragglers", job=job) == 0


@pytest.mark.parametrize(("min_nodes", "excluded"), [(2, ["nc"]), (3, [])])
def test_the_exclude_action_takes_the_straggler_node_out_while_the_job_keeps_its_minimum(etcd_client, min_nodes,
                                                                                          excluded):
    job = f"strag-x{min_nodes}"
    metrics = Metrics()
    nodes = ("na", "nb", "nc")
    for n in nodes:                                  # the job's node records (their agents' reports)
        etcd_client.put_json(etcd_client.key("jobs", job, "nodes", n), {"node": n})
    boxes = {n: Outbox(etcd_client, n, online=lambda: True, offline=lambda: None) for n in nodes}
    watches = {n: StragglerWatch(job, boxes[n], metrics, factor=1.5, window=10.0, action="exclude",
                                 min_nodes=min_nodes) for n in nodes}
    changed_before = etcd_client.get(etcd_client.key("jobs_changed"))[1]
    for t in range(0, 40):
        now = 1000.0 + t
        watches["nc"].tick([_rec(2, t, 0.3)], now)    # 3x slower
        watches["nb"].tick([_rec(1, t, 0.1)], now)
        watches["na"].tick([_rec(0, t, 0.1)], now)    # rank 0: the decider
    assert list(excluded_nodes(etcd_client, job)) == excluded
    events = list_events(etcd_client, job)
    out = [e["detail"] for e in events if e["kind"] == "straggler_excluded"]
    assert [d["node"] for d in out] == excluded, events
    if excluded:
        assert out[0]["ranks"] == [2] and "2 node(s) go on" in out[0]["reason"]
        assert etcd_client.get(etcd_client.key("jobs_changed"))[1] > changed_before   # agents read the jobs at once

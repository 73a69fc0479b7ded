"""The agent's bookkeeping of a job where global rank 0 runs, against the session etcd: progress, series, ledger."""

from __future__ import annotations

from marind.agent.job_journal import JobJournal
from marind.agent.metrics import Metrics
from marind.control import job_history, job_series
from marind.control.events import append_event
from marind.core.progress import ProgressRecord


def rec(rank: int, pid: int, step: int, at: float, phase: str = "training", group: int | None = None) -> ProgressRecord:
    return ProgressRecord(rank=rank, local_rank=rank, world_size=2, pid=pid, step=step, loss=1.0 / (step + 1),
                          tokens_per_s=100.0, last_checkpoint_step=None, phase=phase, updated_at=at,
                          replica_group=group)


def test_rank0s_agent_keeps_the_ledger_and_another_takes_it_over(etcd_client):
    c, job = etcd_client, "journal-1"
    job_history.start_ledger(c, job, at=1000.0)
    append_event(c, job, "node_joined", "a", now=1002.0)
    metrics = Metrics()
    a = JobJournal(job, metrics)
    assert a.report(c, [rec(1, 11, 0, 1005.0)], now=1005.0) is None           # rank 0 is not here: nothing
    for i in range(6):
        a.report(c, [rec(0, 10, i, 1005.0 + i), rec(1, 11, i, 1005.0 + i)], now=1005.5 + i)
    assert c.get_json(c.key("jobs", job, "progress"))["step"] == 5
    assert metrics.value("marind_job_seconds_total", job=job, cause="training") == 5.0
    assert metrics.value("marind_job_seconds_total", job=job, cause="waiting") == 2.0

    # rank 0 moves to another node after a failure: that node's journal goes on from the stored state
    append_event(c, job, "restart", "b", {"reason": "killed"}, now=1012.0)
    a.report(c, [rec(1, 11, 5, 1010.0)], now=1012.5)                           # a forgets; its points written
    assert [p[1] for p in job_series.parse(c.get_json(job_history.series_key(c, job)))["points"]] == [0, 1, 2, 3, 4, 5]
    b = JobJournal(job, Metrics())
    for i in range(4):
        b.report(c, [rec(0, 20, 3 + i, 1015.0 + i)], now=1015.5 + i)
    b.flush(c)
    ledger = job_history.read_ledger(c, job, now=1019.0)
    s = ledger["seconds"]
    assert ledger["start"] == 1000.0 and ledger["wall_s"] == 19.0
    assert s["waiting"] == 2 and s["startup"] == 3 and s["detection"] == 2 and s["restart"] == 3
    assert s["recompute"] == 2 and s["training"] == 5 + 1 + 1          # the last second: held back, shown as training
    assert abs(sum(s.values()) - ledger["wall_s"]) < 0.01
    points = job_series.parse(c.get_json(job_history.series_key(c, job)))["points"]
    assert [p[1] for p in points][-4:] == [3, 4, 5, 6]                        # the rollback is on the curve


def test_under_torchft_only_group_0s_rank_0_keeps_the_books(etcd_client):
    c, job = etcd_client, "journal-ft"
    other = JobJournal(job, Metrics())
    other.report(c, [rec(0, 30, 3, 2000.0, group=1)], now=2000.5)
    assert c.get_json(c.key("jobs", job, "progress"))["step"] == 3
    assert c.get_json(job_history.ledger_key(c, job)) is None and c.get_json(job_history.series_key(c, job)) is None
    JobJournal(job, Metrics()).report(c, [rec(0, 31, 3, 2000.0, group=0)], now=2000.5)
    assert c.get_json(job_history.ledger_key(c, job)) is not None

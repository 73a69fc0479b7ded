"""The agent reads the jobs when {p}/jobs_changed moves, when poked, and at the resync interval.

Synchronised by the watch's own events (a condition with a deadline), never by sleeping.
"""

from __future__ import annotations

import threading
import time

from marind.control.change_watch import ChangeWatch
from marind.control.job_records import create_job, mark_jobs_changed, update_state
from marind.control.lifecycle import JobEvent


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingWatch(ChangeWatch):
    """A ChangeWatch that counts the watch events it receives."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events = 0
        self.cond = threading.Condition()

    def _on_event(self, event) -> None:
        super()._on_event(event)
        with self.cond:
            self.events += 1
            self.cond.notify_all()

    def wait_events(self, n: int, timeout: float, what: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.events >= n, timeout), f"timed out waiting for {what}"


def test_reads_on_change_poke_and_resync(etcd_client):
    clock = Clock()
    watch = CountingWatch(etcd_client, resync_s=5.0, clock=clock)
    try:
        assert watch.due()                       # never read yet
        watch.begin_read()
        assert not watch.due()

        create_job(etcd_client, "j1", {"job": {"name": "x"}})    # submit
        watch.wait_events(1, 10, "the watch to see a submitted job")
        assert watch.due()
        watch.begin_read()
        assert not watch.due()

        seen = watch.events
        update_state(etcd_client, "j1", JobEvent.WORKERS_STARTED, reason="test")   # a state transition
        watch.wait_events(seen + 1, 10, "the watch to see a state change")
        assert watch.due()
        watch.begin_read()

        seen = watch.events
        update_state(etcd_client, "j1", JobEvent.WORKERS_STARTED, reason="again")  # no change of state
        mark_jobs_changed(etcd_client)           # a marker: its event comes after any of the no-op's
        watch.wait_events(seen + 1, 10, "the marker's event")
        assert watch.events == seen + 1, "a write that leaves the state as it was must not wake every agent"
        watch.begin_read()
        assert not watch.due()

        watch.poke()
        assert watch.due()
        watch.begin_read()
        clock.now += 5.0
        assert watch.due(), "resync"
        watch.begin_read()
        seen = watch.events
        mark_jobs_changed(etcd_client)
        watch.wait_events(seen + 1, 10, "an explicit mark")
        assert watch.due()
    finally:
        watch.stop()


def test_following_a_job_reads_it_on_changes_not_every_poll(etcd_client):
    """`submit --wait`'s loop: woken by a watch on the job's keys, so an idle job costs no reads
    between resyncs, and a transition is seen at once."""
    from marind.control.jobs_client import JobsClient

    create_job(etcd_client, "jw", {"job": {"name": "x"}, "train": {"steps": 5}})
    jc = JobsClient(etcd_client)
    reads, seen = [], []
    cond = threading.Condition()
    real_job = jc.job
    jc.job = lambda job: reads.append(time.monotonic()) or real_job(job)

    def on_change(row):
        with cond:
            seen.append(row["state"])
            cond.notify_all()

    def wait_seen(state):
        with cond:
            assert cond.wait_for(lambda: state in seen, 30), f"wait() never reported {state}: {seen}"

    idle = {}

    def transitions():
        wait_seen("PENDING")
        update_state(etcd_client, "jw", JobEvent.WORKERS_STARTED, reason="test")
        wait_seen("RUNNING")
        before, start = len(reads), time.monotonic()
        threading.Event().wait(1.0)         # an idle second: what does following the job cost?
        idle["reads"], idle["s"] = len(reads) - before, time.monotonic() - start
        update_state(etcd_client, "jw", JobEvent.SUCCEEDED, reason="test")

    t = threading.Thread(target=transitions)
    started = time.monotonic()
    t.start()
    row = jc.wait("jw", on_change=on_change, poll=0.05, resync=60.0)
    t.join(30)
    assert not t.is_alive()
    assert row["state"] == "SUCCEEDED" and seen == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert time.monotonic() - started < 30, "the transitions were not seen before the 60 s resync"
    assert idle["reads"] <= 1, f"read {idle['reads']} times in an idle {idle['s']:.1f} s with poll = 0.05 s: " \
                               "the watch did not gate the reads"
    assert len(reads) <= 6, f"read {len(reads)} times with poll = 0.05 s: the watch did not gate the reads"

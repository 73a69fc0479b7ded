"""The agent reads the jobs when {p}/jobs_changed moves, when poked, and at the resync interval."""

from __future__ import annotations

import time

from marind.agent.job_records import create_job, mark_jobs_changed, update_state
from marind.agent.lifecycle import JobEvent
from marind.agent.change_watch import ChangeWatch
from tests.agent.helpers import wait_for


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reads_on_change_poke_and_resync(etcd_client):
    clock = Clock()
    watch = ChangeWatch(etcd_client, resync_s=5.0, clock=clock)
    try:
        assert watch.due()                       # never read yet
        watch.begin_read()
        assert not watch.due()

        create_job(etcd_client, "j1", {"job": {"name": "x"}})    # submit
        wait_for(watch.due, 10, "the watch to see a submitted job")
        watch.begin_read()
        assert not watch.due()

        update_state(etcd_client, "j1", JobEvent.WORKERS_STARTED, reason="test")   # a state transition
        wait_for(watch.due, 10, "the watch to see a state change")
        watch.begin_read()

        update_state(etcd_client, "j1", JobEvent.WORKERS_STARTED, reason="again")  # no change of state
        time.sleep(0.5)
        assert not watch.due(), "a write that leaves the state as it was must not wake every agent"

        watch.poke()
        assert watch.due()
        watch.begin_read()
        clock.now += 5.0
        assert watch.due(), "resync"
        watch.begin_read()
        mark_jobs_changed(etcd_client)
        wait_for(watch.due, 10, "an explicit mark")
    finally:
        watch.stop()


def test_following_a_job_reads_it_on_changes_not_every_poll(etcd_client):
    """`submit --wait`'s loop: woken by a watch on the job's keys, so an idle job costs no reads
    between resyncs, and a transition is seen at once."""
    import threading

    from marind.jobs_client import JobsClient

    create_job(etcd_client, "jw", {"job": {"name": "x"}, "train": {"steps": 5}})
    jc = JobsClient(etcd_client)
    reads, seen = [], []
    real_job = jc.job
    jc.job = lambda job: reads.append(time.monotonic()) or real_job(job)

    def transitions():
        time.sleep(1.0)
        update_state(etcd_client, "jw", JobEvent.WORKERS_STARTED, reason="test")
        time.sleep(1.0)
        update_state(etcd_client, "jw", JobEvent.SUCCEEDED, reason="test")

    t = threading.Thread(target=transitions)
    started = time.monotonic()
    t.start()
    row = jc.wait("jw", on_change=lambda r: seen.append(r["state"]), poll=0.05, resync=60.0)
    t.join()
    assert row["state"] == "SUCCEEDED" and seen == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert time.monotonic() - started < 30, "the transitions were not seen before the 60 s resync"
    assert len(reads) <= 6, f"read {len(reads)} times in ~2 s with poll = 0.05 s: the watch did not gate the reads"

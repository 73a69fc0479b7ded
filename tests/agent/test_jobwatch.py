"""The agent reads the jobs when {p}/jobs_changed moves, when poked, and at the resync interval."""

from __future__ import annotations

import time

from marind.agent.jobs import create_job, mark_jobs_changed, update_state
from marind.agent.jobstate import JobEvent
from marind.agent.jobwatch import JobWatch
from tests.agent.helpers import wait_for


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reads_on_change_poke_and_resync(etcd_client):
    clock = Clock()
    watch = JobWatch(etcd_client, resync_s=5.0, clock=clock)
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

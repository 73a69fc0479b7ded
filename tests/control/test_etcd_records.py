"""Job keys on a real etcd: state by compare-and-swap through the transition function, the event ring."""

from __future__ import annotations

import threading

from marind.control.events import append_event, events_numbered, list_events
from marind.control.job_records import create_job, list_job_ids, read_job, update_state
from marind.control.lifecycle import JobEvent, JobState


def test_state_updates_race_safely(etcd_client):
    assert create_job(etcd_client, "j1", {"job": {"name": "j1", "nproc_per_node": 2}})
    assert not create_job(etcd_client, "j1", {"job": {}})
    assert list_job_ids(etcd_client) == ["j1"]
    results = []

    def restart(n):
        results.append(update_state(etcd_client, "j1", JobEvent.RESTART, restarts=n))
    threads = [threading.Thread(target=restart, args=(n,)) for n in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    view = read_job(etcd_client, "j1")
    assert view.state.state == JobState.RESTARTING and view.state.restarts == 5 and view.nproc_per_node == 2
    assert update_state(etcd_client, "j1", JobEvent.SUCCEEDED).state == JobState.SUCCEEDED
    assert update_state(etcd_client, "j1", JobEvent.FAILED) is None
    assert read_job(etcd_client, "j1").state.state == JobState.SUCCEEDED


def test_event_ring_is_bounded(etcd_client):
    for i in range(7):
        append_event(etcd_client, "j2", "restart", "n1", {"i": i}, keep=3)
    events = list_events(etcd_client, "j2")
    assert [e["detail"]["i"] for e in events] == [4, 5, 6] and events[-1]["node"] == "n1"
    seqs = [e["seq"] for e in events]                   # etcd's create revisions: the job's order
    assert seqs == sorted(set(seqs))
    assert etcd_client.get(etcd_client.key("jobs", "j2", "events", "000000000007"))[0] is not None
    assert etcd_client.count_prefix(etcd_client.key("jobs", "j2", "events") + "/") == 3
    assert events_numbered(etcd_client, "j2") == 7
    assert list_events(etcd_client, "j2", after=seqs[0]) == events[1:]

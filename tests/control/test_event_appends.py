"""The event ring under concurrent appenders, counted by etcd itself (issue 31, item 3).

K threads, each with a client of its own (a node's agent), append one event to the same job at
once. etcd's own request counter (``marind.testing.etcd_metrics``) over a private etcd divides
into requests per append: it must not grow with K (a shared counter taken by compare-and-swap
makes each lost race cost another read and try: O(K) per append, O(K^2) in all), and no event
may be dropped. No timing is measured.
"""

from __future__ import annotations

import threading

from marind.control.events import append_event, list_events
from marind.core.etcd_client import EtcdClient
from marind.testing.etcd_metrics import etcd_counters

PREFIX = "/appends"


def _append_at_once(endpoint: str, job: str, k: int, keep: int = 200) -> float:
    """K clients append one event each, released together; returns etcd requests per append."""
    clients = [EtcdClient(endpoint, prefix=PREFIX) for _ in range(k)]
    try:
        for c in clients:
            c.ping()                               # connected before the count starts
        go = threading.Barrier(k)
        errors: list[BaseException] = []

        def append(i: int) -> None:
            try:
                go.wait(timeout=60)
                append_event(clients[i], job, "node_joined", f"node{i:03d}", {"i": i}, keep=keep)
            except BaseException as exc:            # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=append, args=(i,)) for i in range(k)]
        before = etcd_counters(endpoint)["requests"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        after = etcd_counters(endpoint)["requests"]
        assert not errors, errors[:3]
        assert not any(t.is_alive() for t in threads)
        return (after - before) / k
    finally:
        for c in clients:
            c.close()


def test_requests_per_append_do_not_grow_with_appenders_and_none_is_dropped(etcd_private):
    per_append = {}
    reader = EtcdClient(etcd_private.endpoint, prefix=PREFIX)
    try:
        for k in (8, 32):
            job = f"j{k}"
            per_append[k] = _append_at_once(etcd_private.endpoint, job, k)
            events = list_events(reader, job)
            assert sorted(e["detail"]["i"] for e in events) == list(range(k)), f"K={k}: an event dropped"
            seqs = [e["seq"] for e in events]
            assert seqs == sorted(set(seqs)), f"K={k}: the order is not total: {seqs}"
            assert list_events(reader, job) == events                          # and stable
    finally:
        reader.close()
    print(f"etcd requests per append: {per_append}")
    assert per_append[32] <= per_append[8] + 0.25, f"requests per append grow with the appenders: {per_append}"
    assert per_append[32] <= 3, f"more than 3 requests per append: {per_append}"


def test_the_ring_stays_bounded_under_concurrent_appenders(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix=PREFIX)
    try:
        _append_at_once(etcd_private.endpoint, "ring", 24, keep=8)
        # an appender slower than the ones numbered after it may outlive their trims by one
        # append: the next append removes everything numbered `keep` before it
        append_event(client, "ring", "restart", "n0", {"i": "last"}, keep=8)
        events = list_events(client, "ring")
        assert len(events) == 8 and events[-1]["detail"] == {"i": "last"}
        assert client.count_prefix(client.key("jobs", "ring", "events") + "/") == 8
        newest = list_events(client, "ring", after=events[-2]["seq"])
        assert newest == events[-1:]
    finally:
        client.close()

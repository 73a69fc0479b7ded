"""Etcd3Store: the c10d Store semantics torch's agents rely on, on a real etcd."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from marind.rendezvous import Etcd3Store, store_base


@pytest.fixture
def store(etcd_client):
    return Etcd3Store(etcd_client, "job-s", timeout=timedelta(seconds=5))


def test_keys_live_under_the_job(store, etcd_client):
    store.set("torch.rendezvous.job-s.0/MASTER_ADDR", "host-a")
    base = store_base(etcd_client, "job-s")
    assert base == f"{etcd_client.prefix}/jobs/job-s/rdzv/store/"
    assert etcd_client.get(base + "torch.rendezvous.job-s.0/MASTER_ADDR")[0] == b"host-a"


def test_set_get_bytes_and_str(store):
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"


def test_get_waits_for_a_later_set(store):
    timer = threading.Timer(0.5, store.set, args=("late", "here"))
    timer.start()
    try:
        assert store.get("late") == b"here"
    finally:
        timer.cancel()


def test_get_and_wait_time_out_with_dist_store_error(store):
    store.set_timeout(timedelta(seconds=1))
    # c10d's stores say "timeout" (torch's StoreTestBase matches "[t -i]imeout")
    with pytest.raises(dist.DistStoreError, match=r"timeout after 1s: key 'never'"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match=r"timeout after 0.3s waiting for key 'never'"):
        store.wait(["never"], timedelta(milliseconds=300))


def test_wait_and_check(store):
    assert not store.check(["x", "y"])
    store.set("x", "1")
    assert not store.check(["x", "y"])
    threading.Timer(0.3, store.set, args=("y", "2")).start()
    store.wait(["x", "y"])
    assert store.check(["x", "y"])


def test_add_is_atomic_across_threads(store):
    def bump():
        for _ in range(10):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.add("counter", 0) == 40
    assert store.add("counter", -5) == 35
    assert store.get("counter") == b"35"


def test_compare_set_matches_tcpstore(store):
    # absent key: set only when expected is empty
    assert store.compare_set("k", "nope", "v1") == b"nope"
    assert not store.check(["k"])
    assert store.compare_set("k", "", "v1") == b"v1"
    # present key: swap when equal, else return the current value
    assert store.compare_set("k", "v1", "v2") == b"v2"
    assert store.compare_set("k", "v1", "v3") == b"v2"
    assert store.get("k") == b"v2"


def test_num_keys_and_delete(store):
    store.set("a", "1")
    store.set("b", "2")
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_through_prefix_store_as_torch_uses_it(store):
    prefixed = dist.PrefixStore("torch.rendezvous.job-s.3", store)
    prefixed.multi_set(["role/0", "role/1"], ["r0", "r1"])
    assert prefixed.multi_get(["role/0", "role/1"]) == [b"r0", b"r1"]
    assert store.get("torch.rendezvous.job-s.3/role/1") == b"r1"
    assert prefixed.add("n", 2) == 2


def test_num_keys_delete_and_wait_through_prefix_store(store):
    # c10d reaches a Python store inside a PrefixStore by its C++ method names
    # (getNumKeys, deleteKey): torch elastic wraps the store so every round
    prefixed = dist.PrefixStore("torch.rendezvous.job-s.4", store)
    prefixed.set("a", "1")
    prefixed.add("b", 3)
    assert prefixed.num_keys() == 2
    prefixed.delete_key("a")
    assert prefixed.num_keys() == 1
    assert not prefixed.check(["a"]) and prefixed.check(["b"])
    with pytest.raises(dist.DistStoreError, match="timeout"):
        prefixed.wait(["a"], timedelta(milliseconds=200))


def test_clone_shares_the_keys_and_works_from_another_thread(store):
    twin = store.clone()
    assert isinstance(twin, dist.Store) and twin is not store
    store.set("from-a", "x")
    assert twin.get("from-a") == b"x"
    results = {}
    worker = threading.Thread(target=lambda: results.update(v=store.clone().get("late")))
    worker.start()
    twin.set("late", "y")
    worker.join(timeout=10)
    assert results == {"v": b"y"}


def test_clone_through_prefix_store(store):
    # PrefixStore.clone() clones the inner store through c10d, which then holds only its
    # C++ half: the clone's Python object must stay alive to be callable
    prefixed = dist.PrefixStore("p", store)
    twin = prefixed.clone()
    prefixed.set("k", "v")
    assert twin.get("k") == b"v"
    assert store.get("p/k") == b"v"


def test_delete_rounds_before(store):
    for round_ in (0, 1, 2, 10):
        store.set(f"torch.rendezvous.job-s.{round_}/MASTER_ADDR", "h")
    store.set("unrelated", "kept")
    assert store.delete_rounds_before(2) == 2
    assert not store.check(["torch.rendezvous.job-s.0/MASTER_ADDR"])
    assert not store.check(["torch.rendezvous.job-s.1/MASTER_ADDR"])
    assert store.check(["torch.rendezvous.job-s.2/MASTER_ADDR",
                        "torch.rendezvous.job-s.10/MASTER_ADDR", "unrelated"])


def test_store_get_is_woken_by_watch_not_timeout(store):
    """A blocked get returns soon after the set (bounded by the 5 s store timeout)."""
    threading.Timer(0.2, store.set, args=("soon", "x")).start()
    start = time.monotonic()
    assert store.get("soon") == b"x"
    assert time.monotonic() - start < 5

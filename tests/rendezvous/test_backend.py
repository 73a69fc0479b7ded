"""Etcd3RendezvousBackend against a real etcd: torch's RendezvousBackend contract."""

from __future__ import annotations

import threading

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from marind.core.etcd_client import EtcdClient
from marind.rendezvous import Etcd3RendezvousBackend, state_key


@pytest.fixture
def backend(etcd_client):
    return Etcd3RendezvousBackend(etcd_client, "job-a")


def test_state_key_follows_the_design(etcd_client, backend):
    assert backend.key == f"{etcd_client.prefix}/jobs/job-a/rdzv/state"
    assert state_key(etcd_client, "job-a") == backend.key
    assert backend.name == "etcd3"


def test_empty_run_id_is_rejected(etcd_client):
    with pytest.raises(ValueError):
        Etcd3RendezvousBackend(etcd_client, "")


def test_get_state_is_none_until_set(backend):
    assert backend.get_state() is None


def test_create_then_compare_and_set(backend, etcd_client):
    state, token, ok = backend.set_state(b"v1")
    assert (state, ok) == (b"v1", True)
    assert backend.get_state() == (b"v1", token)
    assert etcd_client.get(backend.key) == (b"v1", token)  # raw bytes, token = mod_revision

    state2, token2, ok2 = backend.set_state(b"v2", token)
    assert (state2, ok2) == (b"v2", True) and token2 > token

    # a stale token loses and gets the current state and token back
    assert backend.set_state(b"stale", token) == (b"v2", token2, False)
    # creating (token None) when a state exists also loses
    assert backend.set_state(b"again") == (b"v2", token2, False)
    assert backend.get_state() == (b"v2", token2)


def test_foreign_token_never_matches(backend):
    _, token, _ = backend.set_state(b"v1")
    for foreign in ("not-a-revision", b"bytes", str(token), -1, 0, True):
        assert backend.set_state(b"x", foreign) == (b"v1", token, False)


def test_foreign_token_without_state_returns_none(backend):
    assert backend.set_state(b"x", "bogus") is None


def test_cas_race_one_writer_wins_and_the_loser_sees_the_winner(etcd, etcd_prefix):
    clients = [EtcdClient(etcd.endpoint, prefix=etcd_prefix) for _ in range(2)]
    try:
        backends = [Etcd3RendezvousBackend(c, "race") for c in clients]
        _, token, _ = backends[0].set_state(b"base")
        barrier = threading.Barrier(2)
        results: list = [None, None]

        def write(i):
            barrier.wait()
            results[i] = backends[i].set_state(f"writer-{i}".encode(), token)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [r for r in results if r[2]]
        losers = [r for r in results if not r[2]]
        assert len(winners) == 1 and len(losers) == 1
        # the loser got exactly the winner's state and token
        assert losers[0][:2] == winners[0][:2]
        assert backends[0].get_state() == winners[0][:2]
    finally:
        for c in clients:
            c.delete_prefix(etcd_prefix)
            c.close()


def test_many_writers_serialise(etcd_client):
    """Every successful write was based on the state it replaced: no lost updates."""
    backend = Etcd3RendezvousBackend(etcd_client, "counter")
    backend.set_state(b"0")

    def bump():
        for _ in range(10):
            while True:
                state, token = backend.get_state()
                _, _, ok = backend.set_state(str(int(state) + 1).encode(), token)
                if ok:
                    break

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert backend.get_state()[0] == b"40"


def test_empty_value_is_a_state_error(backend, etcd_client):
    etcd_client.put(backend.key, b"")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()


def test_lost_etcd_is_a_connection_error_past_the_grace_and_recovers(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/t", timeout=2)
    backend = Etcd3RendezvousBackend(client, "job", grace=1)
    _, token, _ = backend.set_state(b"v1")
    etcd_private.kill()
    try:
        with pytest.raises(RendezvousConnectionError, match=str(etcd_private.client_port)) as err:
            backend.get_state()
        assert "etcd_grace_timeout" in str(err.value)
        with pytest.raises(RendezvousConnectionError):
            backend.set_state(b"v2", token)
        etcd_private.start()  # same data dir and port: the same client recovers
        assert backend.get_state() == (b"v1", token)
        assert backend.set_state(b"v2", token)[2] is True
    finally:
        client.close()


def test_outage_within_the_grace_is_ridden_out(etcd_private):
    """etcd down while get_state/set_state and a store op are in flight, back within the grace."""
    from datetime import timedelta

    from marind.rendezvous import Etcd3Store

    client = EtcdClient(etcd_private.endpoint, prefix="/t", timeout=2)
    backend = Etcd3RendezvousBackend(client, "job", grace=60)
    store = Etcd3Store(client, "job", timeout=timedelta(seconds=30), grace=60)
    _, token, _ = backend.set_state(b"v1")
    results: dict = {}

    def call(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            results[name] = exc

    etcd_private.kill()
    try:
        threads = [threading.Thread(target=call, args=(name, fn)) for name, fn in (
            ("get", backend.get_state),
            ("set", lambda: backend.set_state(b"v2", token)),
            ("add", lambda: store.add("counter", 3)))]
        for t in threads:
            t.start()
        threads[0].join(2)
        assert all(t.is_alive() for t in threads)  # retrying, not failed
        etcd_private.start()
        for t in threads:
            t.join(60)
        assert results["set"][0] == b"v2" and results["set"][2] is True
        # the get may land before or after the set once etcd is back
        assert results["get"] in ((b"v1", token), (b"v2", results["set"][1]))
        assert results["add"] == 3
    finally:
        client.close()

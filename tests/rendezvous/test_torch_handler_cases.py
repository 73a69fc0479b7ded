"""torch's handler-level rendezvous cases, run against marind's etcd3 handler and a real etcd.

Ported from PyTorch's ``test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py``
(``DynamicRendezvousHandlerTest``, ``DynamicRendezvousHandlerFromBackendTest``,
``CreateHandlerTest``, ``IntegrationTest``, and the join-operation cases of
``TestRendezvousJoinOp`` a handler can show; BSD-style licence, Copyright (c)
Facebook, Inc. and its affiliates). torch runs them on mocked state holders and an
in-memory backend; here each case is written anew for real handlers on a real etcd,
checking the same behaviour through the handler's public methods and etcd's keys.
Where marind differs on purpose it says so (a fresh workers' store every round).
The cases about torch's single serialised state (its state holder, its op executor,
its encoded size) have no counterpart in a per-round-keys rendezvous.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta
from unittest.mock import patch

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import join_prefix, spare_prefix, store_base
from marind.rendezvous import Etcd3RendezvousHandler, Etcd3Store, create_etcd3_handler
from tests.agent.helpers import wait_for


@pytest.fixture
def make(etcd, etcd_prefix):
    """make(min, max, run_id="run", **conf) -> a handler; every handler made is shut down after the test."""
    made: list[Etcd3RendezvousHandler] = []

    def _make(min_nodes: int = 1, max_nodes: int = 1, run_id: str = "run", endpoint: str | None = None,
              **conf) -> Etcd3RendezvousHandler:
        conf.setdefault("join_timeout", "30")
        conf.setdefault("last_call_timeout", "1")
        params = RendezvousParameters("etcd3", endpoint or etcd.endpoint, run_id, min_nodes, max_nodes,
                                      prefix=etcd_prefix, **conf)
        handler = create_etcd3_handler(params)
        made.append(handler)
        return handler
    yield _make
    for handler in made:
        handler._stop_heartbeats()
        handler._release()


def _join(*handlers, timeout: float = 60):
    """Every handler's next_rendezvous in a thread of its own; (results, errors) in order."""
    results: list = [None] * len(handlers)
    errors: list = [None] * len(handlers)

    def run(i):
        try:
            results[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors[i] = exc
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, errors


def _keys(client: EtcdClient, prefix: str) -> list[str]:
    return [k[len(prefix):] for k in client.get_prefix_keys(prefix)]


# -- DynamicRendezvousHandlerTest -----------------------------------------------------------------
def test_rank0_hosts_a_new_workers_store_each_round(make):
    """torch: test_share_store_creates_tcp_store. marind starts a new server every round (torch reuses
    its first), so a later generation never meets the previous one's keys."""
    handler = make(local_addr="127.0.0.1")
    info = handler.next_rendezvous()
    first = handler._shared_tcp_store_server
    assert isinstance(first, dist.TCPStore)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("127.0.0.1", first.port)
    info2 = handler.next_rendezvous()
    assert handler._shared_tcp_store_server is not first
    assert info2.bootstrap_store_info.master_port == handler._shared_tcp_store_server.port


def test_the_first_join_attempt_is_skewed_and_later_ones_are_not(make):
    """torch: test_next_rendezvous_skews_the_first_join_attempt."""
    handler = make()
    with patch("marind.rendezvous.etcd3_handler._delay") as delay:
        handler.next_rendezvous()
        assert delay.call_count == 1
        handler.next_rendezvous()
        assert delay.call_count == 1


def test_next_rendezvous_returns_rank_world_and_the_rounds_store(make, etcd_client):
    """torch: test_next_rendezvous_returns_expected_value (ranks in torch's descriptor order)."""
    handlers = [make(3, 3, local_addr=f"127.0.0.{i}") for i in (3, 1, 2)]
    results, errors = _join(*handlers)
    assert errors == [None] * 3
    assert [r.rank for r in results] == [2, 0, 1] and {r.world_size for r in results} == {3}
    results[0].store.set("dummy_key", b"v")
    key = f"{store_base(etcd_client, 'run')}torch.rendezvous.run.0/dummy_key"
    assert etcd_client.get(key)[0] == b"v"
    assert results[1].store.get("dummy_key") == b"v"


def test_next_rendezvous_respects_the_join_timeout_and_leaves_its_round(make, etcd_client):
    """torch: test_next_rendezvous_respects_the_requested_timeout (and its rollback)."""
    handler = make(2, 2, join_timeout="2")
    began = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()
    assert time.monotonic() - began < 15
    assert _keys(etcd_client, join_prefix(etcd_client, "run", 0)) == []


def test_next_rendezvous_moves_to_the_next_round_when_called_again(make):
    """torch: test_next_rendezvous_moves_to_next_round_if_called_repeatedly."""
    handler = make()
    for i in range(4):
        handler.next_rendezvous()
        assert handler._round == i


def test_is_closed_and_set_closed_propagate(make):
    """torch: test_is_closed_returns_expected_value, test_set_closed_closes_rendezvous,
    test_set_closed_can_be_called_multiple_times."""
    a, b = make(), make()
    assert a.is_closed() is False and b.is_closed() is False
    a.set_closed()
    a.set_closed()
    assert a.is_closed() is True and b.is_closed() is True
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_shutdown_closes_the_rendezvous_returns_true_and_may_repeat(make):
    """torch: test_shutdown_closes_rendezvous_and_returns_true, test_shutdown_can_be_called_multiple_times."""
    handler = make()
    handler.next_rendezvous()
    assert handler.shutdown() is True
    assert handler.shutdown() is True
    assert handler.is_closed() is True


def test_num_nodes_waiting_counts_the_nodes_of_the_next_round(make):
    """torch: test_num_nodes_waiting_returns_expected_value."""
    first = make(1, 3)
    first.next_rendezvous()
    assert first.num_nodes_waiting() == 0
    late = [make(1, 3) for _ in range(2)]
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in late]
    for t in threads:
        t.start()
    wait_for(lambda: first.num_nodes_waiting() == 2, 20, "two nodes waiting")
    results, errors = _join(first)          # the group restarts to take them in
    assert errors == [None] and results[0].world_size == 3
    for t in threads:
        t.join(30)


def test_keep_alive_renews_the_lease(make, etcd_client):
    """torch: test_keep_alive_updates_last_heartbeat (a heartbeat here renews the node's lease)."""
    handler = make(keep_alive_interval="60", keep_alive_max_attempt="1")
    handler.next_rendezvous()
    lease_id = handler._lease.id
    time.sleep(2.2)
    remaining, granted = etcd_client.lease_time_to_live(lease_id)
    assert remaining <= granted - 2
    handler._keep_alive()
    remaining, granted = etcd_client.lease_time_to_live(lease_id)
    assert remaining >= granted - 1


def test_keep_alive_thread_starts_with_next_rendezvous_and_stops_with_shutdown(make):
    """torch: test_keep_alive_thread_is_started_with_next_rendezvous_and_stopped_with_shutdown."""
    handler = make()
    name = f"RendezvousKeepAliveTimer_{handler._this_node.local_id}"
    assert all(t.name != name for t in threading.enumerate())
    handler.next_rendezvous()
    assert any(t.name == name for t in threading.enumerate())
    handler.shutdown()
    assert all(t.name != name for t in threading.enumerate())


def test_keep_alive_thread_stops_when_the_handler_is_collected(etcd, etcd_prefix):
    """torch: test_keep_alive_thread_is_started_with_next_rendezvous_and_stopped_with_finalizer."""
    handler = create_etcd3_handler(RendezvousParameters("etcd3", etcd.endpoint, "gc", 1, 1, prefix=etcd_prefix))
    name = f"RendezvousKeepAliveTimer_{handler._this_node.local_id}"
    handler.next_rendezvous()
    assert any(t.name == name for t in threading.enumerate())
    del handler
    gc.collect()
    assert all(t.name != name for t in threading.enumerate())


# -- etcd away: torch's "records and raises" / "swallows" / "respects the timeout" cases -----------
def test_with_etcd_away_calls_raise_rendezvous_errors_and_keep_alive_swallows_them(etcd_private, etcd_prefix):
    """torch: test_is_closed_records_and_raises_exceptions, test_num_nodes_waiting_records_and_raises_exceptions,
    test_shutdown_returns_false_if_rendezvous_cannot_be_closed, test_keep_alive_swallows_rendezvous_errors,
    test_set_closed_respects_the_requested_timeout."""
    params = RendezvousParameters("etcd3", etcd_private.endpoint, "away", 1, 1, prefix=etcd_prefix,
                                  etcd_grace_timeout="60", close_timeout="1", read_timeout="2")
    handler = create_etcd3_handler(params)
    try:
        handler.next_rendezvous()
        handler._waiting.forget()
        etcd_private.kill()
        handler._keep_alive()                      # logged, not raised
        began = time.monotonic()
        with pytest.raises(RendezvousError):
            handler.set_closed()                   # bounded by close_timeout, not the 60 s grace
        assert handler.shutdown() is False
        assert time.monotonic() - began < 20
        handler._rounds.grace = 1
        with pytest.raises(RendezvousError):
            handler.is_closed()
        with pytest.raises(RendezvousError):
            handler.num_nodes_waiting()
    finally:
        handler._stop_heartbeats()


# -- DynamicRendezvousHandlerFromBackendTest and CreateHandlerTest ---------------------------------
def test_create_handler_takes_run_id_bounds_and_timeouts(make):
    """torch: test_init_initializes_handler, test_create_handler_returns_handler."""
    handler = make(3, 6, join_timeout="50", last_call_timeout="60", close_timeout="70")
    assert (handler.get_backend(), handler.get_run_id()) == ("etcd3", "run")
    assert (handler.settings.min_nodes, handler.settings.max_nodes) == (3, 6)
    timeout = handler.settings.timeout
    assert (timeout.join.total_seconds(), timeout.last_call.total_seconds(), timeout.close.total_seconds()) == (
        50, 60, 70)


def test_create_handler_defaults_to_torchs_timeouts(etcd, etcd_prefix):
    """torch: test_create_handler_returns_handler_if_timeout_is_not_specified."""
    handler = create_etcd3_handler(RendezvousParameters("etcd3", etcd.endpoint, "run", 3, 3, prefix=etcd_prefix))
    default = RendezvousTimeout()
    got = handler.settings.timeout
    assert (got.join, got.last_call, got.close, got.heartbeat) == (
        default.join, default.last_call, default.close, default.heartbeat)


@pytest.mark.parametrize("min_nodes, max_nodes, message", [
    (0, 1, r"^The minimum number of nodes \(0\) must be greater than zero.$"),
    (-10, 1, r"^The minimum number of nodes \(-10\) must be greater than zero.$"),
    (3, 2, r"^The maximum number of nodes \(2\) must be greater than or equal to the minimum number of nodes \(3\).$"),
])
def test_the_handler_rejects_bad_bounds(etcd_client, min_nodes, max_nodes, message):
    """torch: test_init_raises_error_if_min_nodes_is_not_positive, ..._if_max_nodes_is_less_than_min
    (built directly: torchrun's RendezvousParameters already refuses a minimum below 1)."""
    settings = RendezvousSettings("run", min_nodes, max_nodes, RendezvousTimeout(),
                                  keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3)
    with pytest.raises(ValueError, match=message):
        Etcd3RendezvousHandler(etcd_client, Etcd3Store(etcd_client, "run"), settings)


def test_local_addr_is_the_workers_store_address(make):
    """torch: test_create_handler_rdzv_local_addr."""
    info = make(local_addr="127.0.0.2").next_rendezvous()
    assert info.bootstrap_store_info.master_addr == "127.0.0.2"


# -- IntegrationTest --------------------------------------------------------------------------------
def test_all_nodes_join_the_rendezvous(make):
    """torch: test_all_nodes_join_rendezvous."""
    a, b = make(2, 2), make(2, 2)
    (ra, rb), errors = _join(a, b)
    assert errors == [None, None]
    assert isinstance(ra.store.underlying_store, Etcd3Store) and isinstance(rb.store.underlying_store, Etcd3Store)
    assert ra.rank != rb.rank and ra.world_size == rb.world_size == 2


def test_a_node_beyond_max_goes_to_the_redundancy_list(make, etcd_client):
    """torch: test_redundancy_list."""
    handlers = [make(2, 2, local_addr=f"127.0.0.{i}") for i in (1, 2, 3)]
    _, errors = _join(*handlers[:2])
    assert errors == [None, None]
    thread = threading.Thread(target=lambda: _join(handlers[2]), daemon=True)
    thread.start()
    spares = spare_prefix(etcd_client, "run", 1)
    wait_for(lambda: _keys(etcd_client, spares), 20, "a spare key")
    assert [k.rsplit("_", 2)[0] for k in _keys(etcd_client, spares)] == ["127.0.0.3"]
    assert handlers[0].num_nodes_waiting() == 0      # a spare asks nobody to restart
    handlers[0].set_closed()
    thread.join(30)


def test_a_spare_moves_to_the_wait_list_when_a_participant_dies(make, etcd_client):
    """torch: test_redundancy_transition_to_wait_list_then_join_rendezvous."""
    first = make(1, 2)
    dying = make(1, 2, keep_alive_interval="1", keep_alive_max_attempt="2")
    _, errors = _join(first, dying)
    assert errors == [None, None]
    spare = make(1, 2)
    thread = threading.Thread(target=lambda: _join(spare), daemon=True)
    thread.start()
    wait_for(lambda: _keys(etcd_client, spare_prefix(etcd_client, "run", 1)), 20, "a spare key")
    dying._stop_heartbeats()                         # its lease expires: it leaves round 0
    wait_for(lambda: first.num_nodes_waiting() == 1, 30, "the spare on the wait list")
    results, errors = _join(first)
    assert errors == [None] and results[0].world_size == 2
    thread.join(30)


def test_use_agent_store_is_true_unless_disabled(make):
    """torch: test_use_agent_store_is_true_by_default, test_use_agent_store_is_disabled."""
    handler = make(1, 2)
    assert handler.use_agent_store is True
    with patch.dict(os.environ, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}):
        assert handler.use_agent_store is False


def test_every_node_gets_rank0s_workers_store(make):
    """torch: test_share_tcp_store_from_backend."""
    a, b = make(2, 2), make(2, 2)
    (ra, rb), errors = _join(a, b)
    assert errors == [None, None]
    host = a if ra.rank == 0 else b
    assert ra.bootstrap_store_info == rb.bootstrap_store_info
    assert ra.bootstrap_store_info.master_port == host._shared_tcp_store_server.port
    assert (a if host is b else b)._shared_tcp_store_server is None


def test_without_a_shared_store_rank0_publishes_a_free_port(make):
    """torch: test_share_tcp_store_is_disabled."""
    a, b = make(2, 2), make(2, 2)
    with patch.dict(os.environ, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}):
        (ra, rb), errors = _join(a, b)
    assert errors == [None, None]
    assert ra.bootstrap_store_info.master_port == rb.bootstrap_store_info.master_port > 0
    assert a._shared_tcp_store_server is None and b._shared_tcp_store_server is None


# -- TestRendezvousJoinOp, as a handler shows it ------------------------------------------------------
def test_a_round_with_min_nodes_waits_the_last_call_and_one_at_max_does_not(make):
    """torch: the join op completes at max nodes at once, at min nodes after the last call."""
    a, b = make(2, 3, run_id="lc", last_call_timeout="2"), make(2, 3, run_id="lc", last_call_timeout="2")
    began = time.monotonic()
    _, errors = _join(a, b)
    assert errors == [None, None] and time.monotonic() - began >= 1.9
    c, d = make(1, 2, run_id="max", last_call_timeout="60"), make(1, 2, run_id="max", last_call_timeout="60")
    began = time.monotonic()
    results, errors = _join(c, d)
    assert errors == [None, None] and {r.world_size for r in results} == {2}
    assert time.monotonic() - began < 30


def test_a_node_that_dies_while_the_round_forms_is_left_out(make, etcd_client):
    """torch: a joiner whose keep-alive expired is dropped before the round completes."""
    lease = etcd_client.lease(2)
    ghost = "10.9.9.9_4242_0"                          # joined, then died: its key expires with its lease
    etcd_client.put(join_prefix(etcd_client, "run", 0) + ghost, "{}", lease=lease)
    a = make(2, 3, last_call_timeout="4")
    thread_result: dict = {}
    thread = threading.Thread(target=lambda: thread_result.update(a=_join(a)), daemon=True)
    thread.start()
    wait_for(lambda: ghost not in _keys(etcd_client, join_prefix(etcd_client, "run", 0)), 20, "the ghost's expiry")
    b = make(2, 3, last_call_timeout="4")
    results, errors = _join(b)
    thread.join(30)
    assert errors == [None] and results[0].world_size == 2
    (ra,), errors_a = thread_result["a"]
    assert errors_a == [None] and ra.world_size == 2

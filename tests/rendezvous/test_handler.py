"""create_etcd3_handler in-process (no workers): options, entry point, rounds, limits."""

from __future__ import annotations

import threading
import time
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from marind.core.netutil import free_port
from marind.core.rdzv_keys import latest_key, rank_key, round_key, spare_prefix
from marind.rendezvous import Etcd3RendezvousHandler, create_etcd3_handler, parse_options
from marind.rendezvous.rounds import rank_order


def _params(endpoint: str, run_id: str = "job", min_nodes: int = 1, max_nodes: int = 1, **conf):
    return RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf)


# -- event names (pure) ----------------------------------------------------------------------
@pytest.mark.unit
def test_frame_method_name_matches_torch_get_method_name():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from marind.rendezvous.state_handler import frame_method_name
    original = dynamic_rendezvous.__dict__.get("get_method_name")
    if original is frame_method_name:      # installed by an earlier test in this process
        pytest.skip("torch's own get_method_name was already replaced in this process")

    def caller_of_caller():
        def caller():
            return original(), frame_method_name(), original(1), frame_method_name(1)
        return caller()
    torch_name, ours, torch_1, ours_1 = caller_of_caller()
    assert (ours, ours_1) == (torch_name, torch_1) == ("caller_of_caller", "caller")
    assert frame_method_name(10_000) == original(10_000) == "no_method_name"


# -- options (pure) -------------------------------------------------------------------------
@pytest.mark.unit
def test_options_defaults_and_endpoint_forms():
    opts = parse_options(_params("10.0.0.1:2379,10.0.0.2:2379"), env={})
    assert opts.endpoints == "10.0.0.1:2379,10.0.0.2:2379"
    assert (opts.prefix, opts.read_timeout, opts.user, opts.tls.ca_cert) == ("/marind", 10, None, None)
    https = parse_options(_params("a:2379,b:2379", protocol="https", cacert="/ca.pem"), env={})
    assert https.endpoints == "https://a:2379,https://b:2379"
    assert https.tls.ca_cert == "/ca.pem"


@pytest.mark.unit
def test_options_auth_from_conf_or_env():
    env = {"MARIND_ETCD_USER": "env-u", "MARIND_ETCD_PASSWORD": "env-p"}
    assert parse_options(_params("h:1"), env=env).user == "env-u"
    conf = parse_options(_params("h:1", user="u", password="p"), env=env)
    assert (conf.user, conf.password) == ("u", "p")
    with pytest.raises(ValueError, match="both a user and a password"):
        parse_options(_params("h:1", user="u"), env={})


@pytest.mark.parametrize("conf, message", [
    ({"cert": "/c.pem"}, "cert= and key="),
    ({"read_timeout": "0"}, "read_timeout"),
    ({"prefix": "/p", "store_timeout": "-3"}, "store_timeout"),
])
@pytest.mark.unit
def test_options_reject_bad_values(conf, message):
    with pytest.raises(ValueError, match=message):
        parse_options(_params("h:1", **conf), env={})


@pytest.mark.unit
def test_options_need_an_endpoint():
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        parse_options(_params(""), env={})


# -- registration and connection --------------------------------------------------------------
@pytest.mark.unit
def test_entry_point_is_registered_with_torch():
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names.get("etcd3") == "marind.rendezvous:create_etcd3_handler"
    assert create_etcd3_handler() is create_etcd3_handler  # torch calls it without arguments
    assert "etcd3" in registry._registry


@pytest.mark.unit
def test_unreachable_etcd_names_the_endpoint():
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        create_etcd3_handler(_params(endpoint, read_timeout="2"))


# -- rounds ----------------------------------------------------------------------------------
def _join_all(handlers):
    results: list = [None] * len(handlers)
    errors: list = [None] * len(handlers)

    def join(i):
        try:
            results[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors[i] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_three_handlers_get_unique_contiguous_ranks(etcd, etcd_prefix):
    params = _params(etcd.endpoint, "round", 3, 3, prefix=etcd_prefix, last_call_timeout="1",
                     join_timeout="30")
    handlers = [create_etcd3_handler(params) for _ in range(3)]
    try:
        assert all(isinstance(h, Etcd3RendezvousHandler) for h in handlers)
        assert handlers[0].get_backend() == "etcd3"
        results, errors = _join_all(handlers)
        assert errors == [None] * 3
        assert sorted(r.rank for r in results) == [0, 1, 2]
        assert {r.world_size for r in results} == {3}
        # every node got rank 0's workers' store address
        assert len({(r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port)
                    for r in results}) == 1
        # the agents' record of the round (its size, no names) and each participant's rank key
        # (docs/design.md §2): torch's rank order, sorted descriptors
        client = handlers[0]._client
        record = client.get_json(round_key(client, "round"))
        assert record["round"] == 0 and record["world_size"] == 3 and "participants" not in record
        by_rank = sorted(zip((r.rank for r in results), (repr(h._this_node) for h in handlers), strict=True))
        assert [desc for _, desc in by_rank] == rank_order(desc for _, desc in by_rank)
        for rank, desc in by_rank:
            assert client.get_json(rank_key(client, "round", 0, desc))["rank"] == rank
        assert client.get(latest_key(client, "round"))[0] == b"0"
    finally:
        for h in handlers:
            h.shutdown()


def test_node_beyond_max_waits_and_does_not_disturb_the_group(etcd, etcd_prefix):
    params = _params(etcd.endpoint, "full", 1, 2, prefix=etcd_prefix, last_call_timeout="1",
                     join_timeout="30")
    handlers = [create_etcd3_handler(params) for _ in range(2)]
    late = create_etcd3_handler(params)
    outcome: list = []
    try:
        results, errors = _join_all(handlers)
        assert errors == [None, None]
        assert sorted(r.rank for r in results) == [0, 1]

        def join_late():
            try:
                outcome.append(late.next_rendezvous())
            except Exception as exc:  # noqa: BLE001 - reported by the test
                outcome.append(exc)

        thread = threading.Thread(target=join_late, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not _in_redundancy_list(handlers[0]):
            time.sleep(0.2)
        assert _in_redundancy_list(handlers[0]), "the late node never registered as waiting"
        assert thread.is_alive() and outcome == []  # the group is full (max 2): it keeps waiting
        assert handlers[0].num_nodes_waiting() == 0  # and a full group is not asked to restart
        handlers[0].set_closed()  # the job ends: the waiting node is let go
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], RendezvousGracefulExitError)
    finally:
        for h in handlers:
            h.shutdown()
        late.shutdown()


def _in_redundancy_list(handler) -> bool:
    """One spare key waits for the round after the full one (torch's redundancy list)."""
    client = handler._client
    return len(client.get_prefix_keys(spare_prefix(client, handler.get_run_id(), 1))) == 1

"""etcd's history stays bounded (``marind.agent.etcd_compaction``) and a request etcd refuses is
said as such (``marind.core.etcd_errors``), on real etcd servers; counted, not timed."""

from __future__ import annotations

import time

import pytest

from marind.agent.etcd_compaction import Compactor, Noted, compaction_action
from marind.control.config import load_config
from marind.control.local_etcd import LocalEtcd
from marind.core import etcd_txn as tx
from marind.core.errors import ControlPlaneRefused, SpecError
from marind.core.etcd_client import EtcdClient
from marind.rendezvous.retry import with_grace
from marind.testing.etcd_metrics import etcd_counters
from tests.agent.helpers import wait_for


@pytest.mark.unit
def test_compaction_is_due_one_interval_after_the_revision_was_noted():
    assert compaction_action(100.0, None, 300)[0] == "note"
    assert compaction_action(100.0, None, 0)[0] == "off"
    assert compaction_action(100.0, Noted(0.0, 7), 0)[0] == "off"
    assert compaction_action(299.0, Noted(0.0, 7), 300)[0] == "wait"
    action, why = compaction_action(300.0, Noted(0.0, 7), 300)
    assert action == "compact" and "revision 7" in why


@pytest.mark.unit
def test_the_compaction_interval_is_off_or_at_least_a_minute(tmp_path):
    assert load_config(env={}).etcd_compact_interval == 300.0
    assert load_config(env={"MARIND_ETCD_COMPACT_INTERVAL": "0"}).etcd_compact_interval == 0
    cfg = tmp_path / "marind.toml"
    cfg.write_text("[etcd]\ncompact_interval = 10\n")
    with pytest.raises(SpecError, match="compact_interval = 10: give 0 .off. or at least 60"):
        load_config(str(cfg), env={})


def test_agents_compact_the_history_one_interval_behind(etcd_private):
    """Reports rewrite records all day: compacted, the history they leave stays bounded."""
    client = EtcdClient(etcd_private.endpoint, prefix="/hist")
    ep = etcd_private.endpoint
    a, b = Compactor(60), Compactor(60)              # two agents
    try:
        a.tick(client, 0.0)                           # note a revision, compact nothing yet
        for i in range(1500):                         # ~2 KB records rewritten: 3 MB of history
            client.put(client.key("jobs", "j", "nodes", f"n{i % 10}"), f"{i:06d}" + "x" * 2000)
        held = etcd_counters(ep)["db_in_use_bytes"]
        a.tick(client, 30.0)                          # under the interval: nothing
        assert a.compacted_to is None
        a.tick(client, 61.0)                          # compacts to the first revision, notes the newest
        b.tick(client, 0.0)
        assert a.compacted_to is not None and a.noted is not None
        newest = a.noted.revision
        a.tick(client, 122.0)                         # the history of the 1,500 writes goes
        assert a.compacted_to == newest
        b.noted = Noted(0.0, newest)
        b.tick(client, 61.0)                          # another agent found it compacted that far: no error
        assert b.compacted_to is None
        wait_for(lambda: etcd_counters(ep)["db_in_use_bytes"] < held / 2, 30,
                 "the compacted history's space freed for reuse")
        with pytest.raises(Exception, match="compacted"):
            client._client.get_response(client.key("jobs", "j", "nodes", "n0"), revision=newest - 100)
    finally:
        client.close()


def test_a_request_etcd_refuses_is_said_as_such_and_not_retried(etcd_private, tmp_path):
    client = EtcdClient(etcd_private.endpoint, prefix="/ref")
    key = client.key("k")
    try:
        began = time.monotonic()
        with pytest.raises(ControlPlaneRefused, match="refused the request .*duplicate key"):
            with_grace(lambda: client.txn([], [tx.put(key, "a"), tx.delete(key)]), 5.0, "test")
        assert time.monotonic() - began < 2.0         # not the grace: no retry changes a refusal
    finally:
        client.close()
    full = LocalEtcd(tmp_path / "small" / "data", quota_bytes=4 * 2**20).start()
    client = EtcdClient(full.endpoint, prefix="/full")
    try:
        with pytest.raises(ControlPlaneRefused, match="space quota .*etcdctl alarm disarm"):
            for i in range(64):                        # 64 x 1 MB into a 4 MB quota: the NOSPACE alarm
                client.put(client.key("big", str(i)), b"x" * 2**20)
    finally:
        client.close()
        full.stop()

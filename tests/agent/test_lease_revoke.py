"""A peer's lease as etcd shows it, revoked by another agent, and the holder's registry noticing (real etcd)."""

from __future__ import annotations

import time

from marind.agent.liveness.silence import silent_peer, unrenewed_for
from marind.agent.registry import NodeRegistry
from marind.core.lease_file import silent_window
from tests.agent.helpers import wait_for


def test_a_peer_lease_ages_until_renewed_and_is_gone_once_revoked(etcd_client):
    lease = etcd_client.lease(10)
    key = etcd_client.key("nodes", "b")
    etcd_client.put(key, "{}", lease=lease)
    lease_id = etcd_client.lease_of(key)
    assert lease_id == lease.id
    remaining, granted = etcd_client.lease_time_to_live(lease_id)
    assert granted == 10 and remaining in (9, 10)
    time.sleep(2.2)
    aged = etcd_client.lease_time_to_live(lease_id)
    assert unrenewed_for(*aged) >= 1.0, aged                  # more than 2.2 s passed: at least 1 s certain
    etcd_client.refresh_lease(lease)
    assert unrenewed_for(*etcd_client.lease_time_to_live(lease_id)) <= 0.0
    assert etcd_client.revoke_lease_id(lease_id) is True
    assert etcd_client.revoke_lease_id(lease_id) is False     # gone already: not an error
    assert etcd_client.lease_time_to_live(lease_id) is None
    assert etcd_client.lease_of(key) is None                  # its keys went with it
    ok, why = silent_peer(down_since=time.time() - 3, now=time.time(), lease=None, window=silent_window(10))
    assert ok and "gone" in why


def test_a_key_without_a_lease_has_none(etcd_client):
    key = etcd_client.key("plain")
    etcd_client.put(key, "x")
    assert etcd_client.lease_of(key) is None
    assert etcd_client.lease_of(etcd_client.key("absent")) is None


def test_the_holder_tells_a_revoked_lease_from_an_expired_one(etcd_client):
    """Revoked by a peer sooner than the TTL allows: ``revoked``; the agent then fences every run."""
    reg = NodeRegistry(etcd_client, "a", slots=1, ttl=4)
    reg.register()
    reg.start()
    try:
        lease_id = etcd_client.lease_of(reg.key)
        assert lease_id == reg.lease.id
        assert etcd_client.revoke_lease_id(lease_id)
        wait_for(lambda: reg.expired, 10, "the keep-alive to find its lease gone")
        assert reg.revoked
        reg.rejoin()
        assert not reg.expired and not reg.revoked and etcd_client.lease_of(reg.key) not in (None, lease_id)
    finally:
        reg.stop()


def test_a_renewal_after_a_silence_does_not_reopen_the_commit_window(etcd_client):
    """Back from a gap longer than the silent window, the node's peers may be declaring it lost right now:
    its first renewal moves ``last_renewal`` but not ``trusted_renewal`` (what lease.json holds); the next does."""
    reg = NodeRegistry(etcd_client, "a", slots=1, ttl=10)
    reg.register()
    assert reg.trusted_renewal == reg.last_renewal
    reg.last_renewal = reg.trusted_renewal = time.time() - 6.0     # as after a 6 s freeze (window 4 s)
    before = reg.trusted_renewal
    reg.start()
    try:
        first = wait_for(lambda: reg.last_renewal > before + 1 and reg.last_renewal, 10, "a renewal")
        assert reg.trusted_renewal == before, "a renewal right after the silence reopened the window"
        wait_for(lambda: reg.trusted_renewal > first - 0.001, 10, "the next renewal reopening it")
    finally:
        reg.stop()


def test_delete_if_only_deletes_the_revision_it_saw(etcd_client):
    key = etcd_client.key("ft", "lighthouse")
    etcd_client.put(key, '{"node": "a"}')
    _, rev = etcd_client.get(key)
    etcd_client.put(key, '{"node": "b"}')          # a new election meanwhile: a new epoch
    assert etcd_client.delete_if(key, rev) is False and etcd_client.get(key)[0] is not None
    _, rev = etcd_client.get(key)
    assert etcd_client.delete_if(key, rev) is True and etcd_client.get(key)[0] is None

"""The fixtures' servers are real: etcd keys, leases, watches; S3 objects across a restart."""

from __future__ import annotations

import threading
import time

import pytest
import s3fs

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient


def test_etcd_put_get_and_compare_and_swap(etcd_client):
    key = etcd_client.key("jobs", "j1", "spec")
    assert etcd_client.create(key, "v1")
    assert not etcd_client.create(key, "v2"), "create must refuse an existing key"
    value, rev = etcd_client.get(key)
    assert value == b"v1" and rev > 0
    ok, new_rev = etcd_client.compare_and_swap(key, "v3", rev)
    assert ok and new_rev > rev
    ok, current = etcd_client.compare_and_swap(key, "stale", rev)
    assert not ok and current == new_rev
    assert etcd_client.get(key)[0] == b"v3"


def test_etcd_lease_expiry_removes_key(etcd_client):
    key = etcd_client.key("nodes", "n1")
    lease = etcd_client.lease(1)
    etcd_client.put(key, "alive", lease=lease)
    assert etcd_client.refresh_lease(lease) > 0
    deadline = time.monotonic() + 10
    while etcd_client.get(key)[0] is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert etcd_client.get(key)[0] is None, "key must vanish when its lease expires"


def test_etcd_watch_sees_puts(etcd_client):
    seen: list[str] = []
    got = threading.Event()

    def on_event(response):
        for event in getattr(response, "events", []):
            seen.append(event.key.decode())
        got.set()

    watch_id = etcd_client.watch_prefix(etcd_client.key("jobs"), on_event)
    try:
        etcd_client.put(etcd_client.key("jobs", "j9", "state"), "{}")
        assert got.wait(10)
    finally:
        etcd_client.cancel_watch(watch_id)
    assert etcd_client.key("jobs", "j9", "state") in seen


def test_etcd_restart_keeps_data_and_down_is_reported(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/t")
    client.put("/t/k", "kept")
    etcd_private.stop()
    with pytest.raises(ControlPlaneUnavailable, match="etcd unreachable"):
        client.get("/t/k")
    time.sleep(3)  # an outage long enough for gRPC's reconnect backoff to grow past 1 s
    with pytest.raises(ControlPlaneUnavailable, match="etcd unreachable"):
        client.get("/t/k")
    etcd_private.start()
    # A client made after the restart must not inherit the dead connection's backoff
    # (gRPC shares subchannels per process by default: this first call failed).
    fresh = EtcdClient(etcd_private.endpoint, prefix="/t")
    assert fresh.get("/t/k")[0] == b"kept"
    # and the long-lived one reconnects by itself
    deadline = time.monotonic() + 20
    while True:
        try:
            assert client.get("/t/k")[0] == b"kept"
            break
        except ControlPlaneUnavailable:
            assert time.monotonic() < deadline, "the old client never reconnected"
            time.sleep(0.1)


def test_s3_write_read_list(s3, s3_url):
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
    path = s3_url[len("s3://"):]
    fs.pipe(f"{path}/a.bin", b"\x00\x01" * 1000)
    fs.pipe(f"{path}/sub/b.bin", b"b")
    assert fs.cat(f"{path}/a.bin") == b"\x00\x01" * 1000
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path)) == ["a.bin", "sub"]


def test_s3_restart_keeps_data(s3_private):
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_private.storage_options)
    fs.pipe(f"{s3_private.bucket}/keep/x", b"payload")
    s3_private.restart()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_private.storage_options)
    assert fs.cat(f"{s3_private.bucket}/keep/x") == b"payload"


def test_an_https_endpoint_never_falls_back_to_plaintext(etcd):
    # https:// without a CA file: TLS with the system's roots, so a plaintext etcd is not
    # reached (the client once opened a plaintext channel to it, and the get succeeded)
    client = EtcdClient(etcd.endpoint.replace("http://", "https://"), prefix="/t", timeout=2)
    with pytest.raises(ControlPlaneUnavailable, match="etcd unreachable"):
        client.get("/t/k")


def test_s3_first_start_picks_new_ports_when_one_was_taken(tmp_path):
    """A port chosen free but taken before ``weed`` binds it (another process got there first):
    the first start tries again on new ports instead of failing the test that needed a server."""
    import socket

    from marind.testing.s3_server import PORT_TAKEN, SeaweedS3

    server = SeaweedS3(tmp_path / "s3")
    taken = server.ports["iceberg"]
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind((server.host, taken))
    squatter.listen(1)
    try:
        server.start()
        try:
            assert taken not in server.ports.values()
            assert any(m in server.log_path.read_bytes() for m in PORT_TAKEN)   # the first try did fail
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
            fs.pipe(f"{server.bucket}/x", b"1")
            assert fs.cat(f"{server.bucket}/x") == b"1"
        finally:
            server.stop()
    finally:
        squatter.close()

"""sd_notify against real AF_UNIX datagram sockets; the metrics server over real HTTP."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request

import pytest

from marind.agent.metrics import Metrics, MetricsServer
from marind.agent.sdnotify import Notifier, watchdog_interval


@pytest.mark.unit
def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled and n.ready() is False


@pytest.mark.parametrize("abstract", [False, True])
def test_messages_reach_a_datagram_socket(tmp_path, abstract):
    name = f"marind-test-{os.getpid()}-{abstract}"
    address = f"@{name}" if abstract else str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode() if abstract else address)
    sock.settimeout(5)
    try:
        n = Notifier(address)
        assert n.ready("up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
        n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        n.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
        for _ in range(500):          # a receiver that stops reading never blocks the sender
            n.status("x")
        n.close()
    finally:
        sock.close()


@pytest.mark.unit
def test_watchdog_interval():
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None or os.getpid() == 1


def test_metrics_exposition_and_server():
    m = Metrics()
    m.inc("marind_restarts_total")
    m.inc("marind_restarts_total")
    m.set("marind_nodes", 3)
    m.observe("marind_checkpoint_duration_seconds", 0.7)
    healthy = {"ok": True}
    server = MetricsServer(m, port=0, healthy=lambda: (healthy["ok"], "state")).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert "# TYPE marind_restarts_total counter" in text and "marind_restarts_total 2" in text
        assert "marind_nodes 3" in text and 'marind_build_info{version="' in text
        assert 'marind_checkpoint_duration_seconds_bucket{le="1"} 1' in text
        assert "marind_checkpoint_duration_seconds_count 1" in text
        assert "marind_etcd_keepalive_failures_total 0" in text
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
        healthy["ok"] = False
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert err.value.code == 503
    finally:
        server.stop()

"""The data probe's handshake (``marind.agent.liveness.probe_handshake``): only a peer agent's probe listener,
with the token it publishes, counts as reached; a refusal, a reset, silence or another program does not."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from marind.agent.liveness.data_probe import DataProber
from marind.agent.liveness.probe_handshake import (
    NO_GREETING,
    NOT_A_PROBE,
    OK,
    WRONG_TOKEN,
    greeting,
    probe_peer,
    reached,
    verdict,
)


@pytest.mark.unit
@pytest.mark.parametrize(("received", "expected", "outcome"), [
    (greeting("abc123"), "abc123", OK),
    (greeting("abc123"), None, OK),                                  # a record without a token: any listener
    (greeting("abc123") + b"trailing", "abc123", OK),
    (greeting("abc123"), "def456", WRONG_TOKEN),                     # another incarnation on the port
    (b"", "abc123", NO_GREETING),                                    # accepted, closed, nothing said
    (b"MARIND-DATA", "abc123", NO_GREETING),                         # cut short
    (b"MARIND-DATA-PROBE/1 abc1", "abc123", NO_GREETING),            # no end of line
    (b"SSH-2.0-OpenSSH_9.6\r\n", "abc123", NOT_A_PROBE),             # another program
    (b"HTTP/1.1 400 Bad Request\r\n", None, NOT_A_PROBE),
    (b"MARIND-DATA-PROBE/1 \n", None, NOT_A_PROBE),                  # no token
    (b"MARIND-DATA-PROBE/1 a b\n", None, NOT_A_PROBE),
    (b"MARIND-DATA-PROBE/2 abc123\n", "abc123", NOT_A_PROBE),        # another protocol version
])
def test_verdict(received, expected, outcome):
    assert verdict(received, expected) == outcome


@pytest.mark.unit
@pytest.mark.parametrize("outcome", [NO_GREETING, NOT_A_PROBE, WRONG_TOKEN, "refused", "reset", "timeout",
                                     "OSError: Network is unreachable"])
def test_only_ok_is_reached(outcome):
    assert reached(OK) and not reached(outcome)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(answer: bytes | None, *, reset: bool = False) -> tuple[socket.socket, int]:
    """A one-thread TCP server on loopback: writes ``answer`` (None: stays silent) or resets each connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            elif answer is not None:
                conn.sendall(answer)
                conn.close()
            else:
                threading.Timer(3.0, conn.close).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


def test_a_probe_listener_is_reached_and_nothing_else_is():
    prober = DataProber("127.0.0.1", probe_s=0.2, timeout_s=1.0).start()
    servers = [_server(b"SSH-2.0-OpenSSH_9.6\r\n"), _server(None), _server(b"", reset=True)]
    try:
        assert probe_peer("127.0.0.1", prober.port, prober.token, 1.0) == OK
        assert probe_peer("127.0.0.1", prober.port, None, 1.0) == OK
        assert probe_peer("127.0.0.1", prober.port, "0" * 16, 1.0) == WRONG_TOKEN
        assert probe_peer("127.0.0.1", _closed_port(), prober.token, 1.0) == "refused"
        assert probe_peer("127.0.0.1", servers[0][1], prober.token, 1.0) == NOT_A_PROBE
        assert probe_peer("127.0.0.1", servers[1][1], prober.token, 0.5) == NO_GREETING    # silent to the deadline
        assert probe_peer("127.0.0.1", servers[2][1], prober.token, 1.0) in ("reset", NO_GREETING)
    finally:
        prober.stop()
        for listener, _ in servers:
            listener.close()


def test_the_prober_counts_a_refusing_port_as_down():
    """The prober's own state: its listener's endpoint is up, a closed port is down since its first probe."""
    prober = DataProber("127.0.0.1", probe_s=0.1, timeout_s=0.5).start()
    try:
        closed = _closed_port()
        prober.want("job", {"self": ("127.0.0.1", prober.port, prober.token),
                            "closed": ("127.0.0.1", closed, prober.token)})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(prober.states("job")) < 2:
            time.sleep(0.05)
        states = prober.states("job")
        assert states["self"].outcome == OK and states["self"].down_since is None, states
        assert states["closed"].outcome == "refused" and states["closed"].down_since is not None, states
        assert states["closed"].ok_at is None
    finally:
        prober.stop()

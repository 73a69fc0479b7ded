"""The transfer service's wire format, and its client (one per remote node).

A message is a 4-byte big-endian length, a JSON header of that length, then
``header["n"]`` bytes of payload (0 when absent). Requests name an ``op``:

* ``put`` {key, n} + the object's bytes: stored whole or not at all; answer {ok};
* ``get`` {key, start, end (null: to the end)}: answer {ok, n} + the bytes, or
  {ok: false, missing: true};
* ``sizes`` {key}, ``list`` {key}, ``exists`` {key}, ``delete`` {key}, ``rename`` {key, new}.

Any failure is {ok: false, error}. Connections are kept and reused (one request at a
time each); a connection that fails is dropped, never retried here: the storage above
decides (a replica that does not land fails the save).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20


class PeerError(OSError):
    """A remote node failed a request or could not be reached."""


def send_msg(sock: socket.socket, header: dict, payload: list | None = None) -> None:
    """One message: ``header`` (its ``n`` set from ``payload``) and the payload's buffers."""
    views = [memoryview(p).cast("B") for p in payload or []]
    header = {**header, "n": sum(v.nbytes for v in views)}
    head = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    for v in views:
        sock.sendall(v)


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | None:
    """Exactly ``n`` bytes (into ``into`` when given, then None); EOFError if the peer closes."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n])
        if k == 0:
            raise EOFError("connection closed mid-message")
        got += k
    return None if into is not None else bytes(buf)


def recv_header(sock: socket.socket) -> dict:
    """The next message's header (its payload, ``n`` bytes, still to be read)."""
    raw = recv_exact(sock, _LEN.size)
    assert raw is not None
    (size,) = _LEN.unpack(raw)
    if size > MAX_HEADER:
        raise PeerError(f"message header of {size} bytes: not a marind memory-checkpoint peer")
    head = recv_exact(sock, size)
    assert head is not None
    return json.loads(head)


class _Reset(Exception):
    """A connection the peer reset (tried once more on a fresh one)."""


class RemoteNode:
    """Requests to one node's transfer server.

    Args:
        addr: its address (the data network's).
        port: its port.
        timeout_s: a request that makes no progress for this long fails (a silent host).
    """

    def __init__(self, addr: str, port: int, timeout_s: float = 30.0):
        self.addr, self.port, self.timeout_s = addr, int(port), timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{self.addr}:{self.port}"

    def _conn(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            sock = socket.create_connection((self.addr, self.port), timeout=self.timeout_s)
        except OSError as exc:
            raise PeerError(f"memory-checkpoint peer {self} unreachable: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, header: dict, payload: list | None = None, into: list | None = None) -> tuple[dict, Any]:
        """Send one request; returns (answer header, payload bytes) or, with ``into`` (buffers to
        fill in order), (answer, bytes filled). A connection the peer reset is retried once on a
        fresh one (every request is idempotent: a put stores the same whole object again).
        Raises PeerError when the peer fails or is silent."""
        try:
            return self._request_once(header, payload, into)
        except _Reset:
            return self._request_once(header, payload, into, retry=False)

    def _request_once(self, header: dict, payload: list | None, into: list | None,
                      retry: bool = True) -> tuple[dict, Any]:
        sock = self._conn()
        try:
            send_msg(sock, header, payload)
            answer = recv_header(sock)
            n = int(answer.get("n", 0))
            if into is None:
                data: Any = recv_exact(sock, n) if n else b""
            else:
                data = _fill(sock, into, n)
        except (OSError, EOFError, ValueError) as exc:
            sock.close()
            if isinstance(exc, PeerError):
                raise
            if retry and isinstance(exc, (ConnectionResetError, BrokenPipeError, EOFError)):
                raise _Reset() from exc
            raise PeerError(f"memory-checkpoint peer {self} failed {header.get('op')} "
                            f"{header.get('key')!r}: {type(exc).__name__}: {exc}") from exc
        with self._lock:
            self._idle.append(sock)
        if not answer.get("ok") and not answer.get("missing"):
            raise PeerError(f"memory-checkpoint peer {self}: {header.get('op')} {header.get('key')!r}: "
                            f"{answer.get('error')}")
        return answer, data

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _fill(sock: socket.socket, bufs: list, n: int) -> int:
    """Read ``n`` payload bytes into ``bufs`` in order (the rest, if any, is drained)."""
    left = n
    for b in bufs:
        v = memoryview(b).cast("B")
        k = min(v.nbytes, left)
        if k:
            recv_exact(sock, k, v)
        left -= k
    filled = n - left
    if left:
        recv_exact(sock, left)
    return filled

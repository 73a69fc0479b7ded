"""A TCP echo server and a probe, run inside the bed's hosts by tests/hosts.

    python -m tests.hosts.netprobe serve PORT
    python -m tests.hosts.netprobe probe ADDR PORT [--timeout S] [--wait-file F]

``probe`` connects, checks one echo, then (with ``--wait-file F``) writes
``F.ready``, waits for F to appear and checks a second echo on the same connection. It
prints one JSON line: ``connect`` and ``recv`` are ``ok``, ``timeout``,
``refused``, ``reset`` or ``unreachable``; ``local``/``hostname`` say where
it ran from.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import threading
import time


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)


def serve(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    return f"error: {exc!r}"


def _roundtrip(sock: socket.socket, payload: bytes) -> str:
    try:
        sock.sendall(payload)
        return "ok" if sock.recv(1024) == payload else "mismatch"
    except OSError as exc:
        return _outcome(exc)


def probe(addr: str, port: int, timeout: float, wait_file: str | None) -> dict:
    out: dict = {"hostname": socket.gethostname(), "target": f"{addr}:{port}"}
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except OSError as exc:
        out["connect"] = _outcome(exc)
        return out
    out["connect"] = "ok"
    out["local"] = sock.getsockname()[0]
    out["echo"] = _roundtrip(sock, b"one")
    if wait_file:
        with open(wait_file + ".ready", "w") as fh:      # connected and echoed: the test may cut now
            fh.write("1")
        deadline = time.monotonic() + 60
        while not os.path.exists(wait_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        out["recv"] = _roundtrip(sock, b"two")
    sock.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    p = sub.add_parser("probe")
    p.add_argument("addr")
    p.add_argument("port", type=int)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--wait-file")
    args = parser.parse_args()
    if args.cmd == "serve":
        serve(args.port)
    else:
        print(json.dumps(probe(args.addr, args.port, args.timeout, args.wait_file)), flush=True)


if __name__ == "__main__":
    main()

"""A TCP echo server and a probe, run inside the bed's hosts by tests/hosts.

    python -m tests.hosts.netprobe serve PORT
    python -m tests.hosts.netprobe probe ADDR PORT [--timeout S] [--wait-file F]
    python -m tests.hosts.netprobe udp-sink PORT --stop-file F
    python -m tests.hosts.netprobe udp-send ADDR PORT COUNT

``probe`` connects, checks one echo, then (with ``--wait-file F``) writes
``F.ready``, waits for F to appear and checks a second echo on the same connection. It
prints one JSON line: ``connect`` and ``recv`` are ``ok``, ``timeout``,
``refused``, ``reset`` or ``unreachable``; ``local``/``hostname`` say where
it ran from. ``udp-sink`` prints ``{"ready": true}`` once bound, counts datagrams until F
appears, then prints ``{"received": N}``; ``udp-send`` sends COUNT one-byte
datagrams, paced (one-way traffic: TCP cannot tell the directions of a one-way drop apart).
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


def udp_sink(port: int, stop_file: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:        # root may exceed rmem_max: no datagram lost to a full buffer while this process waits for a CPU
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 1 << 22)
    except OSError:
        pass
    sock.bind(("0.0.0.0", port))
    sock.settimeout(0.1)
    print(json.dumps({"ready": True}), flush=True)
    received = 0
    deadline = time.monotonic() + 120
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        try:
            sock.recv(64)
            received += 1
        except TimeoutError:
            pass
    sock.setblocking(False)
    try:
        while True:
            sock.recv(64)
            received += 1
    except BlockingIOError:
        pass
    print(json.dumps({"received": received}), flush=True)


def udp_send(addr: str, port: int, count: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(count):
        sock.sendto(b"x", (addr, port))
        if i % 50 == 49:
            time.sleep(0.01)        # no burst beyond the receiver's buffer
    print(json.dumps({"sent": count}), flush=True)


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
    u = sub.add_parser("udp-sink")
    u.add_argument("port", type=int)
    u.add_argument("--stop-file", required=True)
    v = sub.add_parser("udp-send")
    v.add_argument("addr")
    v.add_argument("port", type=int)
    v.add_argument("count", type=int)
    args = parser.parse_args()
    if args.cmd == "serve":
        serve(args.port)
    elif args.cmd == "udp-sink":
        udp_sink(args.port, args.stop_file)
    elif args.cmd == "udp-send":
        udp_send(args.addr, args.port, args.count)
    else:
        print(json.dumps(probe(args.addr, args.port, args.timeout, args.wait_file)), flush=True)


if __name__ == "__main__":
    main()

"""A node's transfer server: serves the node's memory checkpoints (a ``DirStore``) over TCP.

    python -m ckpt_store.memory.server     # reads {"dir", "host", "port", "parent"} on stdin

It writes one JSON line on stdout once it listens (``{"port": N}``), serves requests
(``wire``) on a thread per connection, and exits when stdin closes or its parent dies
(``PR_SET_PDEATHSIG``): it imports no torch, and it holds no state but the directory,
which outlives it (a restarted trainer starts a new server over the same memory).
``start_server`` is the trainer's side.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading

from ckpt_store.memory.dir_store import DirStore
from ckpt_store.memory.wire import recv_exact, recv_header, send_msg

PR_SET_PDEATHSIG = 1


class _Handler(socketserver.BaseRequestHandler):
    store: DirStore

    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                req = recv_header(sock)
            except (EOFError, OSError, ValueError):
                return
            try:
                header, payload = _serve(self.store, req, sock)
            except FileNotFoundError:
                header, payload = {"ok": False, "missing": True}, None
            except EOFError:
                return              # the connection broke mid-payload: the object was never stored
            except Exception as exc:  # noqa: BLE001 - answered to the client
                header, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
            try:
                send_msg(sock, header, payload)
            except OSError:
                return


def _serve(store: DirStore, req: dict, sock: socket.socket) -> tuple[dict, list | None]:
    op, key = req.get("op"), str(req.get("key", ""))
    if op == "put":
        n = int(req["n"])
        buf = bytearray(n)
        try:
            recv_exact(sock, n, memoryview(buf))
        except OSError as exc:
            raise EOFError(str(exc)) from exc
        store.write(key, [buf])     # a failure (a full tmpfs: ENOSPC) is answered
        return {"ok": True}, None
    if op == "get":
        data = store.read_range(key, int(req.get("start") or 0), req.get("end"))
        return {"ok": True}, [data]
    if op == "sizes":
        return {"ok": True, "sizes": store.sizes(key)}, None
    if op == "list":
        return {"ok": True, "names": store.list_dir(key)}, None
    if op == "exists":
        return {"ok": True, "exists": store.exists(key)}, None
    if op == "delete":
        store.delete(key)
        return {"ok": True}, None
    if op == "rename":
        return {"ok": True, "renamed": store.rename(key, str(req["new"]))}, None
    return {"ok": False, "error": f"unknown op {op!r}"}, None


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256   # every rank's I/O threads may connect at once (the default, 5, overflows)


def serve(root: str, host: str, port: int) -> _Server:
    """A server of ``root`` listening on (``host``, ``port``; 0: any free port), not yet serving."""
    handler = type("Handler", (_Handler,), {"store": DirStore(root)})
    return _Server((host, port), handler)


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != cfg["parent"]:
        return 1
    server = serve(cfg["dir"], cfg.get("host", "0.0.0.0"), int(cfg.get("port", 0)))
    threading.Thread(target=server.serve_forever, name="mem-ckpt-server", daemon=True).start()
    sys.stdout.write(json.dumps({"port": server.server_address[1]}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()          # EOF: the trainer closed its end or died
    server.shutdown()
    return 0


def start_server(root: str, host: str = "0.0.0.0", port: int = 0) -> tuple[subprocess.Popen, int]:
    """Start a node's transfer server over ``root``; returns the process and its port.

    Raises:
        RuntimeError: it did not start (its stderr in the message).
    """
    os.makedirs(root, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_store.memory.server"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps({"dir": root, "host": host, "port": port, "parent": os.getpid()}) + "\n").encode())
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        proc.wait()
        raise RuntimeError(f"the memory-checkpoint server did not start: {err.splitlines()[-1:] or 'no output'}")
    return proc, int(json.loads(line)["port"])


def stop_server(proc: subprocess.Popen) -> None:
    """End a server started by ``start_server`` (closing its stdin; killed if it lingers)."""
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())

"""What torchrun runs for a warm-started worker: ``python -m marind.zygote_stub MODULE ARGS...``.

It asks the job's zygote (``$MARIND_ZYGOTE_SOCKET``, see ``marind/zygote.py``)
to fork ``python -m MODULE ARGS`` with this process's environment, working
directory and stdio, forwards every signal it can catch to that worker, and
exits as the worker did (by the same signal, or with the same code). If the
zygote is not there within ``$MARIND_ZYGOTE_WAIT`` seconds (default 30),
refuses, or goes away before the worker started, the stub becomes the worker
itself (``exec python -m MODULE``): a cold start, never a failure.

Imports nothing heavy: it starts in tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import NoReturn

from marind.core.workerenv import ZYGOTE_PREFIX, ZYGOTE_SOCKET, ZYGOTE_WAIT

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGWINCH)


def _cold(module: str, args: list[str], why: str) -> NoReturn:
    if why:
        sys.stderr.write(f"marind.zygote_stub: cold start ({why})\n")
        sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", "-m", module, *args])


def _connect(name: str, wait: float) -> socket.socket | None:
    addr = "\0" + name[1:] if name.startswith("@") else name     # as marind.zygote.address
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(addr)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _read_line(sock: socket.socket, buf: bytearray) -> dict | None:
    while b"\n" not in buf:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m marind.zygote_stub MODULE [ARGS...]\n")
        sys.exit(2)
    module, args = sys.argv[1], sys.argv[2:]
    path = os.environ.get(ZYGOTE_SOCKET)
    if not path:
        _cold(module, args, "")
    sock = _connect(path, float(os.environ.get(ZYGOTE_WAIT, "30")))
    if sock is None:
        _cold(module, args, f"no zygote at {path}")
    # From here a signal is this job's: one that lands before the worker exists is held and sent
    # to it once it does (torchrun may stop a worker the moment it starts).
    worker = 0
    pending: list[int] = []

    def forward(signum, _frame):
        if not worker:
            pending.append(signum)
            return
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass
    for sig in FORWARDED:
        signal.signal(sig, forward)
    lifeline_r, lifeline_w = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith(ZYGOTE_PREFIX)}
    header = json.dumps({"module": module, "args": args, "env": env, "cwd": os.getcwd(),
                         "stub_pid": os.getpid()}).encode() + b"\n"
    buf = bytearray()
    try:
        socket.send_fds(sock, [header], [0, 1, 2, lifeline_r])
        os.close(lifeline_r)
        reply = _read_line(sock, buf)
    except OSError as exc:
        reply, why = None, str(exc)
    else:
        why = "the zygote closed the connection"
    if not reply or "pid" not in reply:
        sock.close()
        os.close(lifeline_w)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        for held in pending:
            os.kill(os.getpid(), held)
        _cold(module, args, why)
    worker = int(reply["pid"])
    for held in pending:
        forward(held, None)

    status = _read_line(sock, buf)    # blocks until the worker ends; the lifeline stays open meanwhile
    if status is None:                # the zygote died: its workers die with it (PDEATHSIG)
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(1)
    if "signal" in status:
        died_by = int(status["signal"])
        if died_by not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(died_by, signal.SIG_DFL)
        os.kill(os.getpid(), died_by)
        time.sleep(1)                 # a signal that does not kill by default (e.g. SIGCONT): fall through
        sys.exit(128 + died_by)
    sys.exit(int(status.get("exit", 1)))


if __name__ == "__main__":
    main()

"""What torchrun runs for each worker: ``python -m marind.agent.warm_start.zygote_stub MODULE ARGS...`` or
``python -m marind.agent.warm_start.zygote_stub --command PROGRAM ARGS...`` (``[job] command``).

It changes into the job's working dir (``$MARIND_WORKING_DIR``; a missing one
is one line on stderr and exit 2), then starts the worker:

* warm (``$MARIND_ZYGOTE_SOCKET`` set, see ``marind/agent/warm_start/zygote.py``): it asks the
  job's zygote to fork the worker with this process's environment, working
  directory and stdio, forwards every signal it can catch to that worker,
  and exits as the worker did (by the same signal, or with the same code);
* cold: it becomes the worker itself (``exec python -m MODULE ARGS`` or
  ``exec PROGRAM ARGS``), when there is no zygote, when the zygote is not
  there within ``$MARIND_ZYGOTE_WAIT`` seconds (default 30), refuses (its
  preload failed: it says so at once), or goes away before the worker
  started, and for a command that is not a python script or module.

A command is warm-startable when it is ``python SCRIPT ARGS`` or ``python -m
MODULE ARGS`` (``python``/``python3`` mean the interpreter torchrun runs
with; ``-u`` may come first): ``python_target`` decides. The zygote then runs
the script's top level in the forked worker only (``runpy``), never in itself.

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

from marind.core.workerenv import WORKING_DIR, ZYGOTE_PREFIX, ZYGOTE_SOCKET, ZYGOTE_WAIT

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGWINCH)
#: Words at the head of ``[job] command`` that mean "the interpreter torchrun runs with".
PYTHON_WORDS = ("python", "python3")
COMMAND_FLAG = "--command"


def is_python(word: str, interpreter: str) -> bool:
    """Does a command's first word run ``interpreter`` (``python``, ``python3``, or its own path)?"""
    return word in PYTHON_WORDS or word == interpreter


def python_target(command: list[str], interpreter: str) -> tuple[tuple[str, str, list[str]] | None, str]:
    """What a zygote could run for ``command``, and why (or why not).

    Args:
        command: ``[job] command``.
        interpreter: the python that torchrun (and the zygote) runs.

    Returns:
        ``(("script", path, args) | ("module", name, args), why)`` when the command is
        ``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE ARGS``; ``(None, why not)``
        otherwise (the worker then starts cold).
    """
    if not command or not is_python(command[0], interpreter):
        return None, f"{command[0] if command else 'an empty command'} is not {interpreter}"
    rest = command[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]             # the worker's output is unbuffered anyway (PYTHONUNBUFFERED=1)
    if len(rest) >= 2 and rest[0] == "-m":
        return ("module", rest[1], rest[2:]), f"python -m {rest[1]}"
    if rest and not rest[0].startswith("-"):
        return ("script", rest[0], rest[1:]), f"python script {rest[0]}"
    return None, "python options other than -u (or no script) need a fresh interpreter"


def cold_argv(command: list[str], interpreter: str) -> list[str]:
    """The argv a cold start execs for ``command`` (``python``/``python3`` become ``interpreter``)."""
    return [interpreter if is_python(command[0], interpreter) else command[0], *command[1:]]


def _cold(target: tuple[str, str, list[str]] | None, command: list[str], why: str) -> NoReturn:
    if why:
        sys.stderr.write(f"marind.agent.warm_start.zygote_stub: cold start ({why})\n")
        sys.stderr.flush()
    if target is not None and target[0] == "module" and not command:
        argv = [sys.executable, "-u", "-m", target[1], *target[2]]
    else:
        argv = cold_argv(command, sys.executable)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"marind.agent.warm_start.zygote_stub: cannot run {argv[0]}: {exc.strerror or exc}; "
                         f"fix [job] command\n")
        sys.exit(127)


def _connect(name: str, wait: float) -> socket.socket | None:
    addr = "\0" + name[1:] if name.startswith("@") else name     # as marind.agent.warm_start.zygote.address
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


def _enter_working_dir() -> None:
    wd = os.environ.get(WORKING_DIR)
    if not wd:
        return
    try:
        os.chdir(wd)
    except OSError as exc:
        sys.stderr.write(f"marind: job.working_dir {wd}: {exc.strerror or exc} on this node; create it "
                         f"(the same path on every node) or change [job] working_dir\n")
        sys.exit(2)


def main() -> None:
    usage = "usage: python -m marind.agent.warm_start.zygote_stub MODULE [ARGS...] | --command PROGRAM [ARGS...]\n"
    argv = sys.argv[1:]
    if not argv or (argv[0] == COMMAND_FLAG and len(argv) < 2):
        sys.stderr.write(usage)
        sys.exit(2)
    _enter_working_dir()
    command: list[str] = []
    if argv[0] == COMMAND_FLAG:
        command = argv[1:]
        target, _ = python_target(command, sys.executable)
    else:
        target = ("module", argv[0], argv[1:])
    path = os.environ.get(ZYGOTE_SOCKET)
    if not path or target is None:
        _cold(target, command, "")
    sock = _connect(path, float(os.environ.get(ZYGOTE_WAIT, "30")))
    if sock is None:
        _cold(target, command, f"no zygote at {path}")
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
    kind, name, args = target
    header = json.dumps({kind: name, "args": args, "env": env, "cwd": os.getcwd(),
                         "stub_pid": os.getpid()}).encode() + b"\n"
    buf = bytearray()
    try:
        socket.send_fds(sock, [header], [0, 1, 2, lifeline_r])
        os.close(lifeline_r)
        reply = _read_line(sock, buf)
    except OSError as exc:
        reply, why = None, str(exc)
    else:
        why = (reply or {}).get("error") or "the zygote closed the connection"
    if not reply or "pid" not in reply:
        sock.close()
        os.close(lifeline_w)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        for held in pending:
            os.kill(os.getpid(), held)
        _cold(target, command, why)
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

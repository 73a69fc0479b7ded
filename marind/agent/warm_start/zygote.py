"""Warm starts: a per-job fork server that has torch imported already.

A restart of a job is mostly spent importing: each new worker loads torch,
torch.distributed and the trainer again (seconds of CPU per rank, paid by
every rank of every node at once). With ``[job] warm_start = true`` (the
default) each node's torchrun gets one *zygote* beside it: a process that
imports torch and the job's ``preload`` modules once and then forks a ready
worker for each request. torchrun still launches and supervises ordinary
processes: ``python -m marind.agent.warm_start.zygote_stub MODULE ARGS`` (or ``--command
python SCRIPT ARGS``; ``marind/agent/warm_start/zygote_stub.py``),
which hands its argv, environment, cwd and stdio to the zygote, forwards
signals to the forked worker and exits with the worker's status, so
torchrun's elastic restarts work exactly as with cold processes.

Process tree (one node, one job)::

    agent ─ torchrun ─┬ zygote_stub (RANK=0) ·····> worker rank 0 (forked by the zygote)
                      ├ zygote_stub (RANK=1) ·····> worker rank 1
                      └ zygote ─┬ worker rank 0
                                └ worker rank 1

The zygote is forked by the PDEATHSIG shim just before it execs torchrun,
so it is torchrun's child, in torchrun's process group, and dies with it;
each worker is tied to its stub by a pipe (the *lifeline*): when the stub
dies, even by SIGKILL, the worker kills itself. ``pids.json`` in the
run directory maps each stub to its worker so that the agent, hang
detection and the chaos injectors act on the real worker.

Forking after ``import torch`` is what torch's own DataLoader does with
the fork start method; the zygote never initialises CUDA or a process
group, so each child starts clean.

What the zygote imports: torch, torch.distributed and the modules the job
names in ``[job] preload`` (``$MARIND_ZYGOTE_PRELOAD``; for the reference
trainer, ``marind.trainer.MARIND_PRELOAD``), from the job's working dir. It
never imports the entrypoint or a script unless preload names it: a
worker's module or script (``[job] command = ["python", "train.py"]``) runs
afresh as ``__main__`` in the forked child (``runpy``), so a script without
a main guard runs once per worker start, in the worker. A preload that
fails (or an import that initialises CUDA) puts the zygote in refusing
mode: it still listens, and answers every stub at once with the reason, so
each worker starts cold without waiting ``$MARIND_ZYGOTE_WAIT``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
from pathlib import Path

from marind.core.jsonfile import write_json_atomic
from marind.core.workerenv import WORKING_DIR

PR_SET_PDEATHSIG = 1
MAX_HEADER = 4 << 20


def _set_pdeathsig(sig: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def address(name: str) -> str:
    """``@name`` is a Linux abstract socket (no file, no path-length trouble); else a path."""
    return "\0" + name[1:] if name.startswith("@") else name


def read_pid_map(path: str | Path) -> dict[int, int]:
    """``{stub_pid: worker_pid}`` as the zygote last wrote it."""
    try:
        return {int(k): int(v) for k, v in json.loads(Path(path).read_text()).items()}
    except (OSError, ValueError):
        return {}


def preload_names(listed: str) -> list[str]:
    """torch, torch.distributed, then the comma-separated modules of ``[job] preload``."""
    names = ["torch", "torch.distributed"]
    return names + [n.strip() for n in listed.split(",") if n.strip() and n.strip() not in names]


class PreloadFailed(Exception):
    """A module of the preload list did not import (the message names it and why)."""


def preload(names: list[str]) -> list[str]:
    """Import ``names`` in order; returns them.

    Raises:
        PreloadFailed: the first module that did not import, with its error.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:         # any import-time error of the user's module
            raise PreloadFailed(f"{name}: {type(exc).__name__}: {exc}") from exc
    return names


def enter_working_dir() -> None:
    """Import from the job's working dir, as its workers do (their ``sys.path[0]``)."""
    wd = os.environ.get(WORKING_DIR)
    if wd and os.path.isdir(wd):
        os.chdir(wd)
        sys.path[0] = wd


def fork_unsafe_reason() -> str | None:
    """Why forking workers from this process would be unsafe (CUDA initialised by an import), if so."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA, which a forked child cannot use"
    return None


# -- the wire: one JSON header + fds from the stub, JSON lines back ---------------------------------
def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_HEADER, 8)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_HEADER)
        if not more:
            raise ConnectionError("the stub hung up mid-request")
        data += more
    return json.loads(data), list(fds)


def send_line(conn: socket.socket, doc: dict) -> None:
    try:
        conn.sendall(json.dumps(doc).encode() + b"\n")
    except OSError:
        pass          # the stub is gone; its worker dies by the lifeline


# -- the forked worker --------------------------------------------------------------------------------
def _watch_lifeline(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _own_session() -> None:
    """A session of its own, as torchrun gives each cold worker. Not only tidiness: with the
    kernel's autogroup scheduling (``sched_autogroup_enabled``, on by default in most distros) CPU
    is shared between sessions first, so workers left in torchrun's session share one slice
    against every other process on the node: in bench/daemon_bench.py's throughput runs, warm
    workers left in torchrun's session were slower than plain torchrun's, cold ones in sessions
    of their own were not (figures: docs/perf.md, "Daemon and warm starts")."""
    try:
        os.setsid()
    except OSError:
        pass


def _run_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: become the worker the stub asked for. Never returns."""
    code = 1
    try:
        _set_pdeathsig(signal.SIGKILL)
        _own_session()
        stdin, stdout, stderr, lifeline = fds
        for src, dst in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(src, dst)
            os.close(src)
        threading.Thread(target=_watch_lifeline, args=(lifeline,), daemon=True, name="lifeline").start()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        import marind.core.log
        marind.core.log._configured = False          # log as the worker's environment says
        import runpy
        if "script" in request:                    # python SCRIPT ARGS: its top level runs here only
            script = os.path.abspath(request["script"])
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` would
            runpy.run_path(script, run_name="__main__")
        else:                                      # python -m MODULE ARGS
            sys.argv = [request["module"], *request["args"]]
            sys.path[0] = os.getcwd()              # as `python -m` would
            sys.modules.pop(request["module"], None)   # if preloaded as a module: it runs afresh as __main__
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - the worker's own failure: print it like python would,
        sys.excepthook(*sys.exc_info())   # through sys.excepthook (torch's prefixes it with [rankN]:)
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# -- the server ---------------------------------------------------------------------------------------
class Zygote:
    """The fork server. ``refusal``: why it cannot fork (a failed preload); every stub is told at once."""

    def __init__(self, socket_name: str, pid_map: str, refusal: str | None = None):
        self.name, self.pid_map, self.refusal = socket_name, Path(pid_map), refusal
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, tuple[socket.socket, int]] = {}     # worker pid -> (conn, stub pid)
        self.listener: socket.socket | None = None
        self.stopping = False

    def listen(self) -> None:
        """Bind only now that the modules are loaded: a stub that can connect gets a warm worker."""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not self.name.startswith("@"):
            Path(self.name).unlink(missing_ok=True)
        self.listener.bind(address(self.name))
        self.listener.listen(64)
        self.sel.register(self.listener, selectors.EVENT_READ)

    def _spawn(self, conn: socket.socket) -> None:
        try:
            request, fds = recv_request(conn)
            if self.refusal is None and len(fds) != 4:
                raise ValueError(f"expected 4 fds (stdin, stdout, stderr, lifeline), got {len(fds)}")
        except (OSError, ValueError, ConnectionError) as exc:
            sys.stderr.write(f"marind.agent.warm_start.zygote: bad request: {exc}\n")
            conn.close()
            return
        if self.refusal is not None:     # read the request first: the stub must not hit a closed socket
            for fd in fds:
                os.close(fd)
            send_line(conn, {"error": self.refusal})   # the stub starts its worker cold, now
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.sel.close()
            if self.listener is not None:
                self.listener.close()
            for other, _ in self.children.values():
                other.close()
            conn.close()
            _run_worker(request, fds)
        for fd in fds:
            os.close(fd)
        self.children[pid] = (conn, int(request.get("stub_pid", 0)))
        self._save_pid_map()
        send_line(conn, {"pid": pid})

    def _reap(self) -> None:
        changed = False
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            conn, _ = entry
            if os.WIFSIGNALED(status):
                send_line(conn, {"signal": os.WTERMSIG(status)})
            else:
                send_line(conn, {"exit": os.WEXITSTATUS(status)})
            conn.close()
            changed = True
        if changed:
            self._save_pid_map()

    def _save_pid_map(self) -> None:
        try:      # through its spare (marind.core.jsonfile): a full disk does not stop it
            write_json_atomic(self.pid_map, {str(stub): pid for pid, (_, stub) in self.children.items()})
        except OSError as exc:        # never a reason to stop forking (the workers die with the zygote)
            sys.stderr.write(f"marind.agent.warm_start.zygote: cannot write {self.pid_map}: {exc}\n")

    def serve(self, parent_pid: int) -> None:
        """Fork workers on request until told to stop (SIGTERM) or torchrun is gone, then outlive
        the workers (they stop on their own SIGTERM; they die with the zygote)."""
        while not (self.stopping and not self.children):
            if os.getppid() != parent_pid:
                self.stopping = True
            for key, _ in self.sel.select(timeout=0.05):
                listener = key.fileobj          # the only registered object
                if not isinstance(listener, socket.socket):
                    continue
                conn, _ = listener.accept()
                if self.stopping:
                    conn.close()               # the stub starts its worker cold
                else:
                    self._spawn(conn)
            self._reap()


def main(argv: list[str] | None = None) -> int:
    """``python -m marind.agent.warm_start.zygote SOCKET PID_MAP PRELOAD PARENT_PID`` (started by the agent's shim).

    ``PRELOAD`` is ``[job] preload``, comma-separated ("" imports torch only).
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4:
        sys.stderr.write("usage: python -m marind.agent.warm_start.zygote SOCKET PID_MAP PRELOAD PARENT_PID\n")
        return 2
    name, pid_map, listed, parent = argv[0], argv[1], argv[2], int(argv[3])
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:
        return 0                                  # torchrun is already gone
    stop_early = lambda *_: os._exit(0)
    signal.signal(signal.SIGTERM, stop_early)
    enter_working_dir()
    refusal = None
    names = preload_names(listed)
    try:
        preload(names)
    except PreloadFailed as exc:     # stubs fall back to cold starts; say why, once and to each
        refusal = f"the zygote could not preload {exc}"
    else:
        refusal = fork_unsafe_reason()
    if refusal:
        sys.stderr.write(f"marind.agent.warm_start.zygote: {refusal}; workers start cold\n")
    else:
        # What was preloaded lives as long as every worker: keep the workers' garbage collector
        # from scanning it (and from touching, so copying, its shared pages) on every full pass.
        gc.collect()
        gc.freeze()
    zygote = Zygote(name, pid_map, refusal)

    def stop(*_):
        zygote.stopping = True
    signal.signal(signal.SIGTERM, stop)
    zygote.listen()
    zygote.serve(parent)
    if not name.startswith("@"):
        Path(name).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun's output reaches ``logs/torchrun.log`` through a relay, so a full disk fails no write of theirs.

torchrun and its workers write their stdout and stderr into a pipe (1 MiB where the system
allows); a small process of its own, ``python -m marind.agent.output_relay LOG``, reads the pipe
and appends to the log. When a write of the relay fails (a full disk: ENOSPC, EDQUOT; or any
other error) it drops what it read, counts the bytes, and tells the agent once (a JSON line on
its stdout, a pipe the agent reads without blocking: ``{"event": "full", "errno", "error"}``);
the first write that goes through again starts with a marker line in the log, ``--- marind: N
bytes of output dropped (ENOSPC: ...)``, and the agent is told ``{"event": "resumed",
"dropped_bytes"}``. Nothing is kept back (no back-fill). So torchrun and its workers never see a
write fail or block on a full disk (a print() to a full file raises in a worker, and kills it);
they block only while the relay is behind by more than the pipe holds, as they would on a slow
disk.

The relay runs in a session of its own (a signal to torchrun's process group, or Ctrl-C at the
agent's terminal, does not reach it), ignores SIGTERM/SIGINT/SIGHUP, and ends when the last
writer closes the pipe (torchrun and every worker gone), so no output is cut off by its end; a
relay whose agent died ends the same way, once the next agent reaped the run. It opens the log
again when the file was removed or replaced (an operator freeing space), at most once a second.
``TorchrunSupervisor`` starts it (:meth:`OutputRelay.start`); stdlib and ``marind.core`` only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from marind.core.disk import error_text

#: bytes read from the pipe at once
CHUNK = 1 << 16
#: the pipe's capacity asked for (Linux's default cap for unprivileged users)
PIPE_BYTES = 1 << 20
#: how often the relay checks that its log file is still the file at its path
REOPEN_CHECK_S = 1.0
_F_SETPIPE_SZ = 1031


def marker(dropped: int, error: str) -> bytes:
    """The log line that stands for ``dropped`` bytes of output the relay could not write."""
    return f"\n--- marind: {dropped} bytes of output dropped here ({error})\n".encode()


class Relay:
    """What the relay writes, given a writer that may fail (its logic; the process is :func:`main`).

    Args:
        write: writes bytes to the log, returns how many went (raises ``OSError``).
        tell: sends one status to the agent.
    """

    def __init__(self, write: Callable[[bytes], int], tell: Callable[[dict], None]):
        self._write, self._tell = write, tell
        self.dropped = 0              # bytes dropped since the last write that went through
        self.error: str | None = None
        self.dropped_total = 0

    def _write_all(self, data: bytes) -> tuple[int, OSError | None]:
        done = 0
        while done < len(data):
            try:
                n = self._write(data[done:])
            except OSError as exc:
                return done, exc
            if n <= 0:
                return done, OSError(errno.EIO, "write returned 0")
            done += n
        return done, None

    def _drop(self, n: int, exc: OSError) -> None:
        if not self.dropped:
            self.error = error_text(exc)
            self._tell({"event": "full", "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                        "error": self.error})
        self.dropped += n
        self.dropped_total += n

    def feed(self, data: bytes) -> None:
        """Write ``data`` to the log, or drop it (counted; the agent told once per episode)."""
        if self.dropped:
            done, exc = self._write_all(marker(self.dropped, self.error or "write failed"))
            if exc is not None:
                self.dropped += len(data)
                self.dropped_total += len(data)
                return
            self._tell({"event": "resumed", "dropped_bytes": self.dropped})
            self.dropped, self.error = 0, None
        done, exc = self._write_all(data)
        if exc is not None:
            self._drop(len(data) - done, exc)


def _open_log(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def main(argv: list[str]) -> int:
    """The relay process: stdin (the pipe) into ``argv[0]`` (the log), statuses on stdout."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    path = argv[0]
    os.set_blocking(1, False)
    fd: int | None = None
    checked = time.monotonic()

    def tell(status: dict) -> None:
        try:
            os.write(1, (json.dumps(status) + "\n").encode())
        except OSError:
            pass                       # the agent is behind or gone: the log's marker says it too

    def write(data: bytes) -> int:
        nonlocal fd, checked
        now = time.monotonic()
        if fd is not None and (relay.dropped or now - checked >= REOPEN_CHECK_S):
            checked = now
            if _replaced(fd, path):
                os.close(fd)
                fd = None
        if fd is None:
            fd = _open_log(path)
        return os.write(fd, data)

    relay = Relay(write, tell)
    while True:
        try:
            data = os.read(0, CHUNK)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        relay.feed(data)
    if relay.dropped:                  # the end of the output never made it: say so if it can be said now
        relay.feed(b"")
    return 0


def _replaced(fd: int, path: str) -> bool:
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino)


class OutputRelay:
    """The agent's handle of one relay: the pipe's write end to hand to torchrun, the statuses.

    Args:
        proc: the relay process.
        fd: the pipe's write end (``handed_over`` closes the agent's copy).
    """

    def __init__(self, proc: subprocess.Popen, fd: int):
        self.proc, self.fd = proc, fd
        self._buf = b""

    @classmethod
    def start(cls, log_path: Path) -> OutputRelay:
        """Start a relay appending to ``log_path``.

        Raises:
            OSError: the pipe or the process could not be made.
        """
        r, w = os.pipe()
        try:
            try:
                fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass                   # the system's default (64 KiB) then
            proc = subprocess.Popen([sys.executable, "-m", "marind.agent.output_relay", str(log_path)],
                                    stdin=r, stdout=subprocess.PIPE, stderr=None, start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        return cls(proc, w)

    def handed_over(self) -> None:
        """torchrun holds the write end now (or could not be started): the agent closes its copy,
        so the relay ends when torchrun and its workers are gone."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def statuses(self) -> list[dict]:
        """What the relay said since the last call (``full``, ``resumed``); never blocks."""
        out = self.proc.stdout
        if out is None or out.closed:
            return []
        try:
            chunk = os.read(out.fileno(), 1 << 16)
        except (BlockingIOError, InterruptedError):
            chunk = b""
        except OSError:
            return []
        lines = (self._buf + chunk).split(b"\n")
        self._buf = lines.pop()
        found = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return [s for s in found if isinstance(s, dict)]

    def done(self) -> bool:
        """The relay has ended (every writer closed the pipe and the rest is in the log)."""
        return self.proc.poll() is not None

    def close(self) -> None:
        """Forget the relay: it ends by itself at the pipe's end; its status pipe is closed."""
        self.handed_over()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

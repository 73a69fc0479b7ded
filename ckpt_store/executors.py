"""Where the background part of a save runs: a writer process (default) or a thread.

Both run ``writer.run_save`` on the same JSON job over the snapshot arena,
one job at a time, in order, and finish the job's ``PendingSave`` once it
committed (and, on rank 0, retention ran). A job is submitted before its
snapshot is copied; ``copied()`` and ``copy_failed()`` then tell the writer
how the copy goes (``handoff.py``). ``ProcessWriter`` keeps the encoding, checksums
and uploads out of the training process, so they never hold its GIL;
``ThreadWriter`` serves ``memory://`` stores (process-local) and storage
options that are not JSON.

A writer process that dies fails its in-flight save (the rank's error
marker, or on rank 0 the abort marker, tells the other ranks at once) and
is started afresh at the next save.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.handoff import SnapshotHandoff
from ckpt_store.steps import MANIFEST
from ckpt_store.writer import fail_part, run_save
from marind.core.log import get_logger

log = get_logger(__name__)
_ROOT = str(Path(__file__).resolve().parents[1])   # holds the ckpt_store and marind packages
CLOSE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0


class ThreadWriter:
    def __init__(self, storage, arena):
        self._st, self._arena = storage, arena
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._handoff: SnapshotHandoff | None = None    # the latest job's
        self.pid = None

    def submit(self, job: dict, pending) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
            self._thread.start()
        self._handoff = SnapshotHandoff()
        self._jobs.put((job, pending, self._handoff))

    def copied(self, slots: int, complete: bool = False) -> None:
        self._handoff.advance(slots, complete)

    def copy_failed(self, error: str) -> None:
        self._handoff.fail(error)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, pending, handoff = item
            try:
                run_save(self._st, job, self._arena.view(), lambda t, pending=pending: pending._finish(None, t), handoff)
            except BaseException as exc:  # noqa: BLE001 - surfaced at wait()/next save()
                log.warning("ckpt_save_failed", step=job["step"], rank=job["rank"], error=str(exc))
                if not pending.done():
                    pending._finish(exc)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(CLOSE_TIMEOUT_S)
            self._thread = None


class _Child:
    """One writer process, and the thread that started it and reads its replies.

    The thread that forks the child must outlive it (PR_SET_PDEATHSIG fires when
    the forking *thread* exits), so this reader thread is the one that starts it.
    """

    def __init__(self, storage, arena, config: dict):
        self._st, self._config = storage, config
        self._arena_fd = arena.fd
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._inflight: list = []          # (job, pending), in submission order
        self._started = threading.Event()
        self.dead = False
        self.proc: subprocess.Popen | None = None
        self.start_error: BaseException | None = None
        threading.Thread(target=self._run, name="ckpt-writer-proc", daemon=True).start()
        if not self._started.wait(START_TIMEOUT_S):
            self.dead = True
            raise CheckpointSaveFailed(f"the checkpoint writer process did not start within {START_TIMEOUT_S}s")
        if self.start_error is not None:
            raise CheckpointSaveFailed(f"cannot start the checkpoint writer process: "
                                       f"{self.start_error}") from self.start_error

    def _run(self) -> None:
        r, w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        try:
            # a session of its own: a signal to the caller's process group (torchrun stops its
            # workers with killpg(SIGTERM)) must not kill the writer of the save the caller makes
            # on that signal; it still dies with the caller (PDEATHSIG, stdin closed)
            self.proc = subprocess.Popen([sys.executable, "-m", "ckpt_store.writer_proc"],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         pass_fds=(self._arena_fd, w), env=env, close_fds=True,
                                         start_new_session=True)
            cfg = {**self._config, "parent": os.getpid(), "arena_fd": self._arena_fd, "reply_fd": w}
            self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
            self.proc.stdin.flush()
        except BaseException as exc:  # noqa: BLE001 - raised by the constructor
            self.start_error, self.dead = exc, True
            os.close(r)
            return
        finally:
            os.close(w)
            self._started.set()
        try:
            with os.fdopen(r, "r") as replies:
                for line in replies:
                    msg = json.loads(line)
                    with self._lock:
                        job, pending = self._inflight.pop(0)
                    if msg.get("ok"):
                        pending._finish(None, msg.get("timings"))
                    else:
                        log.warning("ckpt_save_failed", step=job["step"], rank=job["rank"], error=msg.get("error"))
                        pending._finish(CheckpointSaveFailed(msg.get("error", "writer failed")))
        except Exception as exc:  # noqa: BLE001 - a reply cut short: replies no longer match saves
            log.warning("ckpt_writer_reply_unreadable", error=f"{type(exc).__name__}: {exc}")
            self.proc.kill()      # its saves in flight fail below, as for a writer that died
        code = self.proc.wait()
        with self._lock:
            self.dead = True
            lost, self._inflight = self._inflight, []
        for job, pending in lost:
            self._fail(job, pending, code)

    def _fail(self, job: dict, pending, code: int) -> None:
        """The writer died with ``job`` in flight: committed already, or fail it and tell the others."""
        d = job["dir"]
        try:
            if self._st.exists(f"{d}/{MANIFEST}"):
                pending._finish(None, {})
                return
        except Exception:  # noqa: BLE001 - storage down: the save failed anyway
            pass
        error = f"checkpoint writer process {self.proc.pid} died (exit code {code}) before step {job['step']} committed"
        fail_part(self._st, job, error)
        log.warning("ckpt_writer_died", step=job["step"], rank=job["rank"], code=code)
        pending._finish(CheckpointSaveFailed(error))

    def submit(self, job: dict, pending) -> bool:
        """Queue ``job``; False if this child is dead (the caller starts a new one).
        A job that is not JSON raises here, before anything is queued."""
        line = _line({"op": "save", "job": job})
        with self._lock:
            if self.dead:
                return False
            self._inflight.append((job, pending))
        self._write(line)
        return True

    def send(self, msg: dict) -> None:
        self._write(_line(msg))

    def _write(self, line: bytes) -> None:
        with self._send_lock:   # one message at a time: the snapshot thread sends beside the caller
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass   # it died: the reader thread fails the job when it sees the end of the replies

    def close(self) -> None:
        self._write(_line({"op": "exit"}))
        with self._send_lock:
            try:
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        try:
            self.proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _line(msg: dict) -> bytes:
    return (json.dumps(msg) + "\n").encode()


class ProcessWriter:
    def __init__(self, storage, arena, config: dict):
        """``config``: {url, storage_options, io_threads, rate_limit, nice, direct_io} (JSON)."""
        self._st, self._arena, self._config = storage, arena, config
        self._child: _Child | None = None

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child and self._child.proc else None

    def submit(self, job: dict, pending) -> None:
        """Queue ``job``; a writer that cannot start fails ``pending`` (raised at wait())."""
        for _ in range(2):
            if self._child is None or self._child.dead:
                try:
                    self._child = _Child(self._st, self._arena, self._config)
                except CheckpointSaveFailed as exc:
                    fail_part(self._st, job, str(exc))
                    pending._finish(exc)
                    return
            if self._child.submit(job, pending):
                return
        error = "the checkpoint writer process keeps dying at start"
        fail_part(self._st, job, error)
        pending._finish(CheckpointSaveFailed(error))

    def copied(self, slots: int, complete: bool = False) -> None:
        if self._child is not None:
            self._child.send({"op": "copied", "slots": slots, "complete": complete})

    def copy_failed(self, error: str) -> None:
        if self._child is not None:
            self._child.send({"op": "copy_failed", "error": error})

    def close(self) -> None:
        if self._child is not None and not self._child.dead:
            self._child.close()
        self._child = None

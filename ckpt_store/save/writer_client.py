"""The training process's side of the writer process: start it, send it jobs, read its replies.

``ProcessWriter`` (``writer="process"``, the default for file:// and s3://)
runs each ``SaveJob`` in a writer process (``writer_process.py``, started as
``python -m ckpt_store.save.writer_process``), so the encoding, checksums and
uploads never hold the training process's GIL. Jobs go to it as JSON lines,
one at a time, in order; each job's ``PendingSave`` is finished once the
reply says it committed (and, on rank 0, retention ran) or failed. A job is
submitted before its snapshot is copied; ``copied()`` and ``copy_failed()``
then tell the writer how the copy goes (``handoff.py``). The in-process
alternative is ``thread_writer.ThreadWriter``.

A writer process that dies fails its in-flight save (the rank's error
marker, or on rank 0 the abort marker, tells the other ranks at once) and
is started afresh at the next save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, cast

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.format.steps import MANIFEST
from ckpt_store.log import get_logger
from ckpt_store.save.commit import fail_part
from ckpt_store.save.pending import PendingSave
from ckpt_store.save.save_job import SaveJob
from ckpt_store.save.snapshot import HostArena
from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)
_ROOT = str(Path(__file__).resolve().parents[1])   # holds the ckpt_store package
CLOSE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0


class _Child:
    """One writer process, and the thread that started it and reads its replies.

    The thread that forks the child must outlive it (PR_SET_PDEATHSIG fires when
    the forking *thread* exits), so this reader thread is the one that starts it.
    """

    def __init__(self, storage: Storage, arena: HostArena, config: dict):
        self._st, self._config = storage, config
        self._arena = arena
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
            arena_fd = self._arena.fileno()
            # a session of its own: a signal to the caller's process group (torchrun stops its
            # workers with killpg(SIGTERM)) must not kill the writer of the save the caller makes
            # on that signal; it still dies with the caller (PDEATHSIG, stdin closed)
            proc = self.proc = subprocess.Popen([sys.executable, "-m", "ckpt_store.save.writer_process"],
                                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                pass_fds=(arena_fd, w), env=env, close_fds=True,
                                                start_new_session=True)
            cfg = {**self._config, "parent": os.getpid(), "arena_fd": arena_fd, "reply_fd": w}
            stdin = cast(IO[bytes], proc.stdin)    # stdin=PIPE: never None
            stdin.write((json.dumps(cfg) + "\n").encode())
            stdin.flush()
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
                        pending.finish(None, msg.get("timings"))
                    else:
                        log.warning("ckpt_save_failed", step=job.step, rank=job.rank, error=msg.get("error"))
                        pending.finish(CheckpointSaveFailed(msg.get("error", "writer failed")))
        except Exception as exc:  # noqa: BLE001 - a reply cut short: replies no longer match saves
            log.warning("ckpt_writer_reply_unreadable", error=f"{type(exc).__name__}: {exc}")
            proc.kill()      # its saves in flight fail below, as for a writer that died
        code = proc.wait()
        with self._lock:
            self.dead = True
            lost, self._inflight = self._inflight, []
        for job, pending in lost:
            self._fail(job, pending, proc.pid, code)

    def _fail(self, job: SaveJob, pending: PendingSave, pid: int, code: int) -> None:
        """The writer died with ``job`` in flight: committed already, or fail it and tell the others."""
        d = job.dir
        try:
            if self._st.exists(f"{d}/{MANIFEST}"):
                pending.finish(None, {})
                return
        except Exception:  # noqa: BLE001 - storage down: the save failed anyway
            pass
        error = f"checkpoint writer process {pid} died (exit code {code}) before step {job.step} committed"
        fail_part(self._st, job, error)
        log.warning("ckpt_writer_died", step=job.step, rank=job.rank, code=code)
        pending.finish(CheckpointSaveFailed(error))

    def submit(self, job: SaveJob, pending: PendingSave) -> bool:
        """Queue ``job``; False if this child is dead (the caller starts a new one).
        A job that is not JSON raises here, before anything is queued."""
        line = _line({"op": "save", "job": job.to_json()})
        with self._lock:
            if self.dead:
                return False
            self._inflight.append((job, pending))
        self._write(line)
        return True

    def send(self, msg: dict) -> None:
        """Send ``msg`` (a copy's progress); nothing if the process is gone."""
        self._write(_line(msg))

    def _write(self, line: bytes) -> None:
        stdin = self._stdin()
        with self._send_lock:   # one message at a time: the snapshot thread sends beside the caller
            try:
                stdin.write(line)
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass   # it died: the reader thread fails the job when it sees the end of the replies

    def _started_proc(self) -> subprocess.Popen:
        """The process (only a child that started is ever used: its constructor raises otherwise)."""
        if self.proc is None:
            raise CheckpointSaveFailed("the checkpoint writer process was never started")
        return self.proc

    def _stdin(self) -> IO[bytes]:
        return cast(IO[bytes], self._started_proc().stdin)    # stdin=PIPE: never None

    def close(self) -> None:
        """Ask the process to finish its queued saves and exit; kill it after ``CLOSE_TIMEOUT_S``."""
        self._write(_line({"op": "exit"}))
        proc = self._started_proc()
        with self._send_lock:
            try:
                self._stdin().close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        try:
            proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _line(msg: dict) -> bytes:
    return (json.dumps(msg) + "\n").encode()


class ProcessWriter:
    """A ``SaveWriter`` that runs the jobs in a writer process, started at the first job and
    afresh at the next job after it died.

    Args:
        storage: the store's storage (the error marker of a job the process never got).
        arena: the snapshot memory, which the process maps.
        config: {url, storage_options, io_threads, rate_limit, nice, direct_io} (JSON): how
            the process opens the store.
    """

    def __init__(self, storage: Storage, arena: HostArena, config: dict):
        self._st, self._arena, self._config = storage, arena, config
        self._child: _Child | None = None

    @property
    def pid(self) -> int | None:
        """The writer process's pid (None before the first job)."""
        return self._child.proc.pid if self._child and self._child.proc else None

    def submit(self, job: SaveJob, pending: PendingSave) -> None:
        """Queue ``job``; a writer that cannot start fails ``pending`` (raised at wait())."""
        for _ in range(2):
            if self._child is None or self._child.dead:
                try:
                    self._child = _Child(self._st, self._arena, self._config)
                except CheckpointSaveFailed as exc:
                    fail_part(self._st, job, str(exc))
                    pending.finish(exc)
                    return
            if self._child.submit(job, pending):
                return
        error = "the checkpoint writer process keeps dying at start"
        fail_part(self._st, job, error)
        pending.finish(CheckpointSaveFailed(error))

    def copied(self, slots: int, complete: bool = False) -> None:
        """The latest job's first ``slots`` slots are copied; ``complete``: the whole copy is sound."""
        if self._child is not None:
            self._child.send({"op": "copied", "slots": slots, "complete": complete})

    def copy_failed(self, error: str) -> None:
        """The latest job's copy failed: its part fails."""
        if self._child is not None:
            self._child.send({"op": "copy_failed", "error": error})

    def cancel(self, step: int, error: str) -> None:
        """The ranks agreed the save of ``step`` failed: the latest job stops, failed."""
        if self._child is not None:
            self._child.send({"op": "cancel", "step": step, "error": error})

    def close(self) -> None:
        """Let the process finish its queued jobs and exit."""
        if self._child is not None and not self._child.dead:
            self._child.close()
        self._child = None

"""The writer process: runs each rank's background save part outside the training process.

Started by ``writer_client.ProcessWriter`` as ``python -m
ckpt_store.save.writer_process``. It imports no torch. Protocol (JSON lines):

* stdin, first line: config ``{parent, arena_fd, reply_fd, url, storage_options,
  io_threads, rate_limit, nice, direct_io}``; then ``{"op": "save", "job": {...}}`` per save (``SaveJob.to_json``),
  then ``{"op": "copied", "slots": n, "complete": bool}`` as the
  caller's snapshot copy goes on (or ``{"op": "copy_failed", "error"}``),
  ``{"op": "cancel", "step", "error"}`` when the ranks agreed that the latest save failed
  (its part stops writing or waiting for the commit, and fails), and
  ``{"op": "exit"}`` to finish the queued saves and exit;
* the reply fd: ``{"step", "ok": true, "timings"}`` once a save committed, or
  ``{"step", "ok": false, "error"}``.

It reads the snapshot from the parent's memfd (``arena_fd``). It dies with its
parent (PR_SET_PDEATHSIG, and stdin EOF ends it at once): a save whose trainer
is gone never completes, so it never commits.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import queue
import signal
import sys
import threading

from ckpt_store.save.commit import fail_part
from ckpt_store.save.handoff import SnapshotHandoff
from ckpt_store.save.rank_part import run_save
from ckpt_store.save.save_job import SaveJob
from ckpt_store.storage.protocol import Storage, open_storage

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)


def _work(st: Storage, arena_fd: int, jobs: queue.Queue, reply) -> None:
    mm, size = None, 0
    while True:
        item = jobs.get()
        if item is None:
            return
        job, handoff = item
        sent: list[bool] = []

        def on_commit(timings, step=job.step, sent=sent):
            reply.write(json.dumps({"step": step, "ok": True, "timings": timings}) + "\n")
            sent.append(True)

        started = False
        try:
            if job.arena_size != size:   # the arena grew (0: this rank owns no chunk yet)
                mm = mmap.mmap(arena_fd, job.arena_size, prot=mmap.PROT_READ) if job.arena_size else None
                size = job.arena_size
            started = True
            run_save(st, job, memoryview(mm) if mm is not None else memoryview(b""), on_commit, handoff)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            error = f"{type(exc).__name__}: {exc}"
            if not started:
                fail_part(st, job, f"rank {job.rank}'s writer could not start its part: {error}")
            if not sent:
                reply.write(json.dumps({"step": job.step, "ok": False, "error": error}) + "\n")


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    _die_with_parent(cfg["parent"])
    if cfg.get("nice"):
        os.nice(cfg["nice"])
    st = open_storage(cfg["url"], cfg.get("storage_options"), io_threads=cfg["io_threads"],
                      rate_limit=cfg.get("rate_limit"), direct_io=cfg.get("direct_io", "auto"))
    reply = os.fdopen(cfg["reply_fd"], "w", buffering=1)
    jobs: queue.Queue = queue.Queue()
    worker = threading.Thread(target=_work, args=(st, cfg["arena_fd"], jobs, reply), daemon=True)
    worker.start()
    handoff: SnapshotHandoff | None = None   # the latest job's
    step: int | None = None                  # and its step
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "exit":
            jobs.put(None)
            worker.join()
            reply.flush()
            os._exit(0)
        if msg["op"] == "copied":
            if handoff is not None:
                handoff.advance(msg["slots"], msg.get("complete", False))
        elif msg["op"] == "copy_failed":
            if handoff is not None:
                handoff.fail(msg["error"])
        elif msg["op"] == "cancel":
            if handoff is not None and step == msg["step"]:
                handoff.cancel(msg["error"])
        else:
            handoff, step = SnapshotHandoff(), msg["job"]["step"]
            jobs.put((SaveJob.from_json(msg["job"]), handoff))
    os._exit(1)  # stdin closed: the trainer is gone; never finish (never commit) its save


if __name__ == "__main__":
    sys.exit(main())

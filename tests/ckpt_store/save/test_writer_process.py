"""The writer process: used for file://, cleaned up, dies with its trainer, and a killed
writer never commits (its save fails at wait(), the next save starts a fresh one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckpt_store import CheckpointSaveFailed, CheckpointStore
from marind.testing import procs


def _state(value: float, rows: int = 256) -> dict:
    return {"model": {f"p{i}": torch.full((rows, 1024), value + i) for i in range(4)},
            "extra": {"v": value}}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _loads(store: CheckpointStore, value: float, rows: int = 256) -> bool:
    target = _state(0.0, rows)
    store.load(target)
    return all(torch.equal(target["model"][k], _state(value, rows)["model"][k]) for k in target["model"])


def test_file_store_writes_through_a_torch_free_process_that_close_ends(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    assert store.writer_pid is None
    store.save(1, _state(1.0), async_=False)
    pid = store.writer_pid
    assert pid is not None and pid != os.getpid() and _alive(pid)
    with open(f"/proc/{pid}/maps") as fh:
        assert "libtorch" not in fh.read()       # the writer never imports torch
    store.save(2, _state(2.0, rows=512)).wait(timeout=60)   # a bigger snapshot: the arena grows
    assert store.writer_pid == pid
    assert store.steps() == [1, 2] and _loads(store, 2.0, rows=512)
    store.close()
    assert _gone(pid)


def test_thread_writer_and_memory_store(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", writer="thread")
    store.save(1, _state(1.0)).wait(timeout=60)
    assert store.writer_pid is None and _loads(store, 1.0)
    with pytest.raises(ValueError, match="memory://"):
        CheckpointStore("memory://x", writer="process")


def test_killed_writer_never_commits_and_the_next_save_restarts_it(tmp_path):
    root = tmp_path / "ckpt"
    CheckpointStore(f"file://{root}").save(1, _state(1.0), async_=False)
    store = CheckpointStore(f"file://{root}", io_rate_limit=1 << 20)   # 4 MiB state: ~4 s
    store.save(0, {"x": torch.zeros(1)}, async_=False)                  # starts the writer
    first = store.writer_pid
    pending = store.save(2, _state(2.0))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any((root / "step-0000000002").rglob("c/*")):
        time.sleep(0.02)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(CheckpointSaveFailed, match="writer process .* died"):
        pending.wait(timeout=60)
    assert not (root / "step-0000000002" / "manifest.json").exists()
    assert (root / "step-0000000002" / ".marind" / "abort.json").exists()   # rank 0 told the others
    assert store.steps() == [0, 1] and store.latest() == 1 and _loads(store, 1.0)
    store.save(3, _state(3.0)).wait(timeout=60)
    assert store.writer_pid not in (None, first)
    assert store.steps() == [0, 1, 3] and _loads(store, 3.0)
    store.close()


_TRAINER = textwrap.dedent("""
    import sys, torch
    from ckpt_store import CheckpointStore
    state = {"model": {f"p{i}": torch.full((256, 1024), float(i)) for i in range(8)}}
    CheckpointStore(sys.argv[1]).save(1, state, async_=False)
    store = CheckpointStore(sys.argv[1], io_rate_limit=1 << 20)
    store.save(2, state)
    print(store.writer_pid, flush=True)
    import time; time.sleep(600)
""")


def test_writer_dies_with_its_trainer_and_never_commits(tmp_path):
    root = tmp_path / "ckpt"
    trainer = procs.spawn([sys.executable, "-c", _TRAINER, f"file://{root}"], stdout=subprocess.PIPE)
    line = trainer.stdout.readline()
    assert line.strip(), "the trainer did not start its save"
    writer = int(line)
    assert _alive(writer)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(30)
    assert _gone(writer), "the writer process outlived its trainer"
    store = CheckpointStore(f"file://{root}")
    assert store.steps() == [1] and not (root / "step-0000000002" / "manifest.json").exists()


def test_a_writer_that_cannot_start_fails_the_save_at_wait(tmp_path, monkeypatch):
    from ckpt_store.save import writer_client

    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    monkeypatch.setattr(writer_client.sys, "executable", str(tmp_path / "no-such-python"))
    pending = store.save(1, _state(1.0))
    with pytest.raises(CheckpointSaveFailed, match="cannot start the checkpoint writer"):
        pending.wait(timeout=60)
    # rank 0's abort marker: the other ranks of a real job stop waiting now, not at their timeout
    abort = json.loads((tmp_path / "ckpt" / "step-0000000001" / ".marind" / "abort.json").read_text())
    assert "cannot start the checkpoint writer" in abort["error"]
    monkeypatch.undo()
    store.save(2, _state(2.0)).wait(timeout=60)   # the next save starts a writer
    assert store.steps() == [2] and _loads(store, 2.0)
    store.close()

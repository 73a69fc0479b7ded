"""The writer starts on a snapshot while it is still being copied, and reports its part
done only once the copy is whole: a copy that fails partway never commits."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import torch

import ckpt_store.save.snapshot as snapshot
from ckpt_store import CheckpointSaveFailed, CheckpointStore
from ckpt_store.format.steps import step_dir
from ckpt_store.save.handoff import SnapshotHandoff


@pytest.mark.unit
def test_a_slot_is_written_only_once_copied_and_the_part_only_once_complete():
    handoff = SnapshotHandoff()
    got: list = []
    waiting: queue.Queue = queue.Queue()     # what the writer waits for next, said just before it waits

    def writer():
        for i in range(3):
            waiting.put(i)
            handoff.wait_slot(i, 10)
            got.append(i)
        waiting.put("complete")
        handoff.wait_complete(10)
        got.append("done")
    t = threading.Thread(target=writer)
    t.start()
    assert waiting.get(timeout=10) == 0
    _not_yet(handoff.wait_slot, 0)                   # slot 0 not copied: the writer is held there
    assert got == []
    handoff.advance(2)
    assert [waiting.get(timeout=10) for _ in range(2)] == [1, 2]
    _not_yet(handoff.wait_slot, 2)
    assert got == [0, 1]
    handoff.advance(3)
    assert waiting.get(timeout=10) == "complete"
    _not_yet(handoff.wait_complete)
    assert got == [0, 1, 2], "the part must wait for the copy to be declared complete"
    handoff.advance(3, complete=True)
    t.join(10)
    assert got == [0, 1, 2, "done"]


def _not_yet(wait, *args) -> None:
    """``wait`` (a handoff wait) does not return: what it waits for has not happened."""
    with pytest.raises(CheckpointSaveFailed, match="did not reach"):
        wait(*args, 0)


@pytest.mark.unit
def test_a_failed_copy_fails_every_waiter_and_a_whole_snapshot_waits_for_nothing():
    handoff = SnapshotHandoff()
    handoff.advance(2)
    handoff.fail("tensor changed in place")
    with pytest.raises(CheckpointSaveFailed, match="changed in place"):
        handoff.wait_complete(1)
    with pytest.raises(CheckpointSaveFailed, match="did not reach slot 0"):
        SnapshotHandoff().wait_slot(0, 0.05)
    ready = SnapshotHandoff()
    ready.advance(2, complete=True)
    ready.wait_slot(1, 0)
    ready.wait_complete(0)


def _state():
    torch.manual_seed(0)
    return {"w": torch.randn(1024, 1024), "b": torch.randn(4096, 512), "meta": {"epoch": 1}}


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_copy_that_fails_partway_raises_at_save_and_never_commits(tmp_path, monkeypatch, writer):
    store = CheckpointStore(f"file://{tmp_path}/c", writer=writer)
    state = _state()
    store.save(1, state, async_=False)
    fill = snapshot.fill

    chunks = {key: obj["size"] for key, obj in store.manifest(1)["objects"].items() if "/c/" in key}
    assert chunks

    def fails_at_the_end(copies, arena, on_progress=None, every_bytes=snapshot.PROGRESS_BYTES):
        fill(copies, arena, on_progress=on_progress, every_bytes=1)
        on_progress(len(copies))     # the writer may write every slot: all but "complete"
        _wait_until(lambda: _written(tmp_path / "c" / step_dir(2), chunks), 60)   # and it did
        raise RuntimeError("device lost during the copy")
    monkeypatch.setattr(snapshot, "fill", fails_at_the_end)
    with pytest.raises(RuntimeError, match="device lost"):
        store.save(2, state, async_=False)
    monkeypatch.setattr(snapshot, "fill", fill)
    assert store.steps() == [1] and store.latest() == 1
    assert not os.path.exists(tmp_path / "c" / step_dir(2) / "manifest.json")
    store.save(2, state, async_=False)          # the same step saves clean afterwards
    assert store.steps() == [1, 2] and store.verify(2).ok
    target = {"w": torch.zeros(1024, 1024), "b": torch.zeros(4096, 512), "meta": {}}
    store.load(target, step=2)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    store.close()


def _written(d, chunks: dict) -> bool:
    """Every chunk object of ``chunks`` ({key: size}) is in ``d``, whole."""
    return all((d / key).is_file() and (d / key).stat().st_size == size for key, size in chunks.items())


def _wait_until(ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "the writer did not write the copied slots"
        time.sleep(0.01)

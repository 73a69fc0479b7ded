"""Saves (and one load) at the edges: a rank with nothing to write, bad step numbers, a job
the writer cannot take, a step saved below the newest, a step deleted under its save, a
failure nobody waited for, a load that fails on one rank only."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch

from ckpt_store import CheckpointError, CheckpointSaveFailed, CheckpointStore
from ckpt_store.save.save_job import SaveJob
from ckpt_store.store import PendingSave
from marind.testing.procs import run_torch_workers


def test_a_save_of_json_values_only_commits(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", commit_timeout_s=20)   # the writer process
    store.save(1, {"extra": {"epoch": 3}}, async_=False)
    state = {"extra": {"epoch": 0}}
    store.load(state)
    assert store.steps() == [1] and state == {"extra": {"epoch": 3}}
    store.close()


def test_ranks_that_own_no_chunk_commit_with_the_one_that_does(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    results = run_torch_workers("tests.ckpt_store.workers:tiny_replicated", 2, timeout=120,
                                url=url, commit_timeout_s=30)
    assert results == [{"ok": True, "steps": [1]}] * 2, results


def test_bad_step_numbers_and_retention_counts_are_refused(url):
    store = CheckpointStore(url)
    state = {"w": torch.ones(3)}
    for bad, kind in ((-1, ValueError), (10**10, ValueError), (2.5, TypeError), ("7", TypeError),
                      (True, TypeError)):
        with pytest.raises(kind, match="checkpoint step"):
            store.save(bad, state, async_=False)
    store.save(np.int64(3), state, async_=False)   # any integer type is a step
    assert store.steps() == [3]
    for kwargs in ({"keep_last": -1}, {"keep_every": 0}, {"keep_last": 1.5}, {"commit_timeout_s": 0}):
        with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
            CheckpointStore(url, **kwargs)


def test_a_job_the_writer_cannot_take_leaves_the_next_save_working(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    store.save(1, {"w": torch.ones(3)}, async_=False)
    with pytest.raises(TypeError):   # not JSON: refused before it is queued
        store._writer.submit(SaveJob(step=2, dir="step-0000000002", rank=0, world=1, fmt=1, commit_timeout_s=60,
                                     values={"bad": object()}, arrays={}, saved_layout={}), PendingSave(2))
    pending = store.save(3, {"w": torch.ones(3)})
    pending.wait(timeout=60)         # answered by its own reply, not the refused job's
    assert store.steps() == [1, 3]
    store.close()


def test_a_step_saved_below_the_newest_is_kept_by_retention(url):
    store = CheckpointStore(url, keep_last=1)
    state = {"w": torch.ones(3)}
    store.save(200, state, async_=False)
    store.save(150, state, async_=False)    # a run resumed from an older step
    assert store.steps() == [150, 200]
    store.save(160, state, async_=False)
    assert store.steps() == [160, 200]
    store.save(210, state, async_=False)    # past the abandoned step: plain keep_last again
    assert store.steps() == [210]


def test_a_step_deleted_under_its_save_never_commits(url):
    slow = CheckpointStore(url, io_rate_limit=4e6)              # 8 MiB: about 2 s of writes
    other = CheckpointStore(url, keep_last=1)
    big = {f"w{i}": torch.randn((1 << 20) // 4) for i in range(8)}
    pending = slow.save(5, big)
    deadline = time.monotonic() + 30
    while not slow.storage.list_dir("step-0000000005/w0") and time.monotonic() < deadline:
        time.sleep(0.01)
    other.save(10, {"w": torch.ones(3)}, async_=False)   # its retention removes step 5 as a leftover
    with pytest.raises(CheckpointSaveFailed, match="step 5 did not commit"):
        pending.wait(timeout=60)
    assert slow.steps() == [10]
    slow.close()
    other.close()


def test_close_raises_a_failed_save_nobody_waited_for(tmp_path):
    root = tmp_path / "ckpt"
    store = CheckpointStore(f"file://{root}", io_rate_limit=20_000)
    store.save(1, {"model": {"w": torch.ones(64)}}, async_=False)
    store.save(2, {"model": {"w": torch.ones(64)}})
    (root / "step-0000000002").mkdir(parents=True, exist_ok=True)
    (root / "step-0000000002" / "model").write_text("a file where a directory must go")
    with pytest.raises(CheckpointSaveFailed, match="step 2 did not commit"):
        store.close()
    assert CheckpointStore(f"file://{root}").steps() == [1]


def test_close_after_a_failure_that_was_seen_does_not_raise(tmp_path):
    root = tmp_path / "ckpt"
    store = CheckpointStore(f"file://{root}", io_rate_limit=20_000)
    pending = store.save(2, {"model": {"w": torch.ones(64)}})
    (root / "step-0000000002").mkdir(parents=True, exist_ok=True)
    (root / "step-0000000002" / "model").write_text("a file where a directory must go")
    with pytest.raises(CheckpointSaveFailed):
        pending.wait(timeout=60)
    store.close()
    assert not os.path.exists(root / "step-0000000002" / "manifest.json")
    with pytest.raises(CheckpointError):
        CheckpointStore(f"file://{root}").load({"model": {"w": torch.zeros(64)}})


def test_a_load_that_fails_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_torch_workers("tests.ckpt_store.workers:load_fails_on_one_rank", 2, timeout=120,
                                url=f"file://{tmp_path}/ckpt")
    assert results[1]["raised"] == "CheckpointMismatch", results
    assert results[0]["raised"] == "CheckpointError" and "another rank" in results[0]["error"], results


def _two_views_of_steps_1_and_2(tmp_path):
    """Steps 1 and 2 saved under ``a``, and ``b`` a copy of it: the store as rank 0 and rank 1
    will see it (each test then changes ``b``)."""
    seen_by_0, seen_by_1 = tmp_path / "a", tmp_path / "b"
    store = CheckpointStore(f"file://{seen_by_0}")
    for step in (1, 2):
        store.save(step, {"model": {"w": torch.full((4,), float(step))}, "extra": {"step": step}},
                   async_=False)
    store.close()
    shutil.copytree(seen_by_0, seen_by_1)
    return seen_by_0, seen_by_1

def test_every_rank_of_a_load_tries_rank_0s_steps_in_the_same_order(tmp_path):
    """Listings taken a moment apart can differ (a step committed or deleted in between);
    here rank 1 does not see step 2 at all. The ranks must still agree on one step."""
    seen_by_0, seen_by_1 = _two_views_of_steps_1_and_2(tmp_path)
    shutil.rmtree(seen_by_1 / "step-0000000002")
    results = run_torch_workers("tests.ckpt_store.workers:load_newest", 2, timeout=120,
                                urls=[f"file://{seen_by_0}", f"file://{seen_by_1}"])
    # rank 1 finds no manifest for step 2 while rank 0 reads it: the shared read of the object
    # lists raises CheckpointNotFound on both (test_commit_scale), so both skip it alike
    assert results == [{"step": 1, "w": [1.0] * 4}] * 2, results
    assert CheckpointStore(f"file://{seen_by_0}").steps() == [1, 2]   # gone elsewhere is not corrupt here


def test_a_manifest_unreadable_on_one_rank_fails_the_load_on_every_rank_without_skipping(tmp_path):
    """An OSError reading step 2's manifest on rank 1 says nothing about the step: every rank
    raises (rank 0 an error naming rank 1), none falls back to step 1, nothing is quarantined."""
    seen_by_0, seen_by_1 = _two_views_of_steps_1_and_2(tmp_path)
    manifest = seen_by_1 / "step-0000000002" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()                  # reading it is IsADirectoryError on rank 1 only
    results = run_torch_workers("tests.ckpt_store.workers:load_newest_outcome", 2, timeout=120,
                                urls=[f"file://{seen_by_0}", f"file://{seen_by_1}"])
    assert results[1]["raised"] == "IsADirectoryError", results
    assert results[0]["raised"] == "CheckpointError", results
    assert "rank 1 failed to read the manifest: IsADirectoryError" in results[0]["error"], results
    assert CheckpointStore(f"file://{seen_by_0}").steps() == [1, 2]
    assert not (seen_by_0 / "step-0000000002" / "manifest.corrupt.json").exists()


def test_sub_mesh_copies_write_each_chunk_once_and_load_exactly(tmp_path):
    import json

    from tests.ckpt_store import workers

    root = tmp_path / "ckpt"
    run_torch_workers("tests.ckpt_store.workers:sub_meshes", 4, timeout=150, url=f"file://{root}")
    markers = sorted((root / "step-0000000001" / "parts").glob("rank-*.json"))   # each rank's object list
    writes: dict = {}
    for marker in markers:
        for key in json.loads(marker.read_text())["objects"]:
            if "/c/" in key:
                writes.setdefault(key, []).append(marker.name)
    assert len(markers) == 4 and writes
    assert {k: v for k, v in writes.items() if len(v) > 1} == {}   # no chunk written by two ranks
    assert len({m for v in writes.values() for m in v}) > 1          # and the copies shared the work
    store = CheckpointStore(f"file://{root}")
    target = {"model": {"norm": torch.zeros(10, 7), "emb": torch.zeros(10, 7),
                        "wb": torch.zeros(9, 6, dtype=torch.bfloat16)}}
    store.load(target, step=1)
    assert torch.equal(target["model"]["norm"], workers.expected("model/w"))
    assert torch.equal(target["model"]["emb"], workers.expected("optim/w/exp_avg"))
    assert torch.equal(target["model"]["wb"], workers.expected("model/wb"))
    assert store.verify(1).ok


@pytest.mark.parametrize("mode,names", [("step", "steps by rank"), ("array", "'model/only_here' is held by ranks [1] only")])
def test_ranks_that_disagree_on_what_they_save_all_refuse(tmp_path, mode, names):
    results = run_torch_workers("tests.ckpt_store.workers:disagreeing_save", 2, timeout=120,
                                url=f"file://{tmp_path}/ckpt", mode=mode)
    assert [r["raised"] for r in results] == ["CheckpointError"] * 2, results
    assert all(names in r["error"] for r in results), results
    assert CheckpointStore(f"file://{tmp_path}/ckpt").steps() == []


def test_a_save_commits_only_while_its_fence_file_allows(tmp_path):
    """A world that may have been replaced (its node lease lapsed) never commits (marind's lease.json)."""
    import json
    fence = tmp_path / "lease.json"
    store = CheckpointStore(f"file://{tmp_path}/ckpt", commit_timeout_s=20, fence_file=str(fence))
    store.save(1, {"w": torch.ones(3)}, async_=False)                   # no file yet: nothing to fence
    fence.write_text(json.dumps({"valid_until": time.time() + 60}))
    store.save(2, {"w": torch.ones(3)}, async_=False)
    fence.write_text(json.dumps({"valid_until": time.time() + 1.5, "ttl": 4}))   # margin 2 s capped at ttl/4: 1 s
    store.save(3, {"w": torch.ones(3)}, async_=False)
    fence.write_text(json.dumps({"valid_until": time.time() - 1}))     # the lease may have expired
    with pytest.raises(CheckpointSaveFailed, match="replaced"):
        store.save(4, {"w": torch.ones(3)}, async_=False)
    assert store.steps() == [1, 2, 3]
    assert not os.path.exists(tmp_path / "ckpt" / "step-000000004" / "manifest.json")
    store.close()

"""Real SeaweedFS S3 and real SIGKILL: uncommitted saves never become visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckpt_store import CheckpointSaveFailed, CheckpointStore
from marind.testing import procs
from tests.ckpt_store import workers


def test_s3_roundtrip_verify_and_sharded_layouts(s3, s3_url):
    store = CheckpointStore(s3_url, storage_options=s3.storage_options, inner_chunk_bytes=64)
    store.save(3, workers.make_state("rep")).wait(timeout=60)
    r = procs.run_torch_workers("tests.ckpt_store.workers:matrix", 2, timeout=150, url=s3_url,
                                save=True, load_steps=[3], storage_options=s3.storage_options)
    assert all(x["failures"] == [] for x in r), [x["failures"] for x in r]
    assert store.steps() == [3, *r[0]["saved"]]
    assert store.verify(r[0]["saved"][-1]).ok


def test_s3_outage_mid_save_never_commits(s3_private):
    url = s3_private.url("outage")
    opts = {**s3_private.storage_options,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
    store = CheckpointStore(url, storage_options=opts, commit_timeout_s=20, io_rate_limit=2 << 20)
    state = {"model": {f"p{i}": torch.full((256, 1024), float(i)) for i in range(8)}}  # 8 MiB: ~4 s
    store.save(1, state, async_=False)
    pending = store.save(2, {"model": {k: v + 1 for k, v in state["model"].items()}})
    time.sleep(0.5)
    s3_private.stop()
    try:
        pending.wait(timeout=120)
        raise AssertionError("save 2 committed although the server was stopped mid-upload")
    except CheckpointSaveFailed:
        pass
    s3_private.start()
    fresh = CheckpointStore(url, storage_options=s3_private.storage_options)
    assert fresh.latest() == 1 and fresh.steps() == [1]
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    fresh.load(target)
    assert all(torch.equal(target["model"][k], state["model"][k]) for k in state["model"])


def test_sigkill_of_a_saving_rank_leaves_previous_step(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    procs.run_torch_workers("tests.ckpt_store.workers:save_big", 2, timeout=120, url=url, step=1, mb=4)
    # step 2, throttled to ~2 MiB/s per rank: rank 1 is killed while uploading
    port = __import__("marind.core.netutil", fromlist=["free_port"]).free_port()
    args = tmp_path / "args.json"
    args.write_text(__import__("json").dumps({"url": url, "step": 2, "mb": 16, "rate": 2 << 20,
                                              "commit_timeout_s": 8.0}))
    children = []
    for rank in range(2):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        children.append(procs.spawn([sys.executable, "-m", "marind.testing.worker_main",
                                     "tests.ckpt_store.workers:save_big", str(args),
                                     str(tmp_path / f"result{rank}.json")], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    step_dir = Path(tmp_path / "ckpt" / "step-0000000002" / "model")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(step_dir.rglob("c/*")):
        time.sleep(0.02)
    assert any(step_dir.rglob("c/*")), "the save never started writing"
    os.kill(children[1].pid, signal.SIGKILL)
    children[0].wait(90)
    store = CheckpointStore(url)
    assert not (tmp_path / "ckpt" / "step-0000000002" / "manifest.json").exists()
    assert store.steps() == [1] and store.latest() == 1
    assert store.verify(1).ok
    n = 4 * (1 << 20) // 4 // 1024
    target = {"model": {f"p{i}": torch.zeros(n // 8, 1024) for i in range(8)}}
    store.load(target)
    assert all(torch.all(target["model"][f"p{i}"] == float(1 + i)) for i in range(8))


def test_s3_retention_uncommits_the_old_step_at_once_and_deletes_its_objects(s3, s3_url):
    """keep_last=1 on S3: the old step is uncommitted before the new save reports, and its objects
    are deleted once it has (a save's time does not include deleting an old checkpoint)."""
    import fsspec

    store = CheckpointStore(s3_url, storage_options=s3.storage_options, keep_last=1)
    state = {"model": {f"p{i}": torch.full((64, 64), float(i)) for i in range(4)}}
    store.save(1, state, async_=False)
    store.save(2, state, async_=False)
    assert store.steps() == [2] and store.latest() == 2          # step 1 no longer committed, already
    fs, root = fsspec.core.url_to_fs(s3_url, **s3.storage_options)
    deadline = time.monotonic() + 30
    while True:
        fs.invalidate_cache()
        left = [p for p in fs.find(root) if "/step-0000000001/" in p]
        if not left:
            break
        assert time.monotonic() < deadline, f"step 1's objects are still there 30 s after: {left[:3]}"
        time.sleep(0.2)
    store.close()
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    CheckpointStore(s3_url, storage_options=s3.storage_options).load(target)
    assert all(torch.equal(target["model"][k], state["model"][k]) for k in state["model"])


def test_a_rank_waiting_for_the_commit_rides_out_a_storage_blip(s3_private):
    """A rank polling for rank 0's manifest keeps polling through an outage shorter than
    ``commit_timeout_s`` (failing there would split the ranks: rank 0 commits the step)."""
    import threading

    from ckpt_store.save.commit import wait_for_commit
    from ckpt_store.storage.protocol import open_storage

    opts = {**s3_private.storage_options,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2}}
    st = open_storage(s3_private.url("blip"), opts)
    outcome: list = []

    def wait():
        try:
            wait_for_commit(st, "step-0000000001", timeout_s=120)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - the test's answer
            outcome.append(exc)

    poller = threading.Thread(target=wait, daemon=True)
    poller.start()
    s3_private.stop()
    time.sleep(1.0)       # polls every 50 ms: a score of them meet a server that is not there
    s3_private.start()
    st.write_json_atomic("step-0000000001/manifest.json", {"committed": True})
    poller.join(60)
    assert outcome == [None], outcome

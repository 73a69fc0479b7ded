"""Non-finite gradients are skipped and rolled back; SIGTERM stops cleanly with progress records."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from ckpt_store import CheckpointStore
from marind.testing.procs import kill_group, run_torch_workers, spawn
from marind.trainer.config import load_trainer_spec
from marind.trainer.data import corpus

SPEC = """
[job]
name = "fault-test"
nproc_per_node = 2
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {steps}
max_bad_steps = 2
[checkpoint]
url = "file://{ckpt}"
every_steps = {every}
keep_last = 0
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 30)
    return str(prefix)


def test_nan_gradient_is_skipped_then_rolled_back(data, tmp_path):
    spec = load_trainer_spec(SPEC.format(data=data, ckpt=tmp_path / "ckpt", steps=8, every=2), check_worlds=False)
    res = run_torch_workers("tests.trainer.workers:train_and_digest", 1, timeout=120,
                            env={"MARIND_TEST_NAN_AT_STEP": "3,5,6"}, spec=spec.to_dict())[0]
    # step 3 skipped alone; 5 and 6 in a row hit max_bad_steps=2 -> back to step 4, then 5..8 again
    assert res["skipped_steps"] == [3, 5, 6]
    assert res["rollbacks"] == 1
    assert res["step"] == 8
    assert res["data_position"] == (8 + 2) * 4  # the rolled-back batches are not replayed
    assert all(loss == loss for loss in res["losses"])  # finite losses only


def _progress(run_dir, rank):
    try:
        return json.loads((run_dir / "progress" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def test_sigterm_stops_cleanly_under_torchrun(data, tmp_path):
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(SPEC.format(data=data, ckpt=tmp_path / "ckpt", steps=100000, every=3))
    run_dir = tmp_path / "run"
    log_path = tmp_path / "out.log"
    with open(log_path, "wb") as log:
        proc = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      "-m", "marind.trainer", str(spec_path)],
                     env={"MARIND_RUN_DIR": run_dir, "MARIND_JOB_ID": "job-sigterm"},
                     stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        recs = [_progress(run_dir, r) for r in (0, 1)]
        if all(r and r["step"] >= 4 and r["last_checkpoint_step"] for r in recs):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"trainer did not reach step 4: {log_path.read_text()[-3000:]}")
    kill_group(proc, signal.SIGTERM)
    try:
        rc = proc.wait(90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainer did not stop within 90 s of SIGTERM: {log_path.read_text()[-3000:]}")
    out = log_path.read_text()
    assert rc != 0, out[-2000:]
    recs = [_progress(run_dir, r) for r in (0, 1)]
    for rank, rec in enumerate(recs):
        assert rec["phase"] == "done" and rec["rank"] == rank and rec["world_size"] == 2, rec
        assert set(rec) == {"rank", "local_rank", "world_size", "pid", "step", "loss", "tokens_per_s",
                            "last_checkpoint_step", "phase", "updated_at", "metrics", "compute_s", "phase_s"}
        assert rec["metrics"]["peak_memory_bytes"] > 0     # every rank's own peak, in its final record
    assert '"event": "stopping"' in out and '"job": "job-sigterm"' in out
    latest = CheckpointStore(f"file://{tmp_path / 'ckpt'}").latest()
    assert latest is not None and latest == recs[0]["last_checkpoint_step"]
    assert latest == recs[0]["step"] == recs[1]["step"]      # checkpoint.on_stop: the step reached is saved


@pytest.mark.parametrize("held_rank,expected", [(None, [2, 4, 6]), (1, [6])])
def test_a_save_held_on_one_rank_is_skipped_on_all(data, tmp_path, held_rank, expected):
    """Under an agent, a due save is skipped on every rank when one rank's lease file holds commits
    (here: fenced on ``held_rank``). The ranks agree through the loop's per-step all-reduce
    (``Checkpointer.held_here`` / ``agree_held``): a rank that skipped while another saved would
    leave the saver waiting in the save's collectives."""
    text = SPEC.format(data=data, ckpt=tmp_path / "ckpt", steps=6, every=2) + 'prepare_timeout = "60s"\n'
    spec = load_trainer_spec(text, check_worlds=False).to_dict()
    results = run_torch_workers("tests.trainer.workers:train_with_commits_held", 2, timeout=180, spec=spec,
                                run_root=str(tmp_path / "runs"), held_rank=held_rank)
    assert [r["step"] for r in results] == [6, 6]
    # the periodic saves were skipped everywhere; the final save (waited for) is not skipped,
    # and rank 0, whose own lease allows it, commits it
    assert results[0]["steps"] == expected

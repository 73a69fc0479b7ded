"""A checkpoint volume that fills mid-run: training never stops stepping for it (issue 32).

The real trainer, 2 ranks under torchrun, checkpoints every 5 steps (``keep_last = 0``) onto a
24 MiB tmpfs. Once a few steps committed the test fills the volume with ballast; the saves then
fail on a real ENOSPC, on one rank or both. Every rank learns each failure (the ranks agree on a
save's outcome: ``CheckpointStore.settle``), so none is left alone in a collective: the run
reaches its last step. Then the ballast goes and the later saves commit. Every committed step
verifies, the newest loads, and the progress record (``checkpoint_error``: what ``status`` and
``events`` show under an agent) names the full disk and the fix while it lasts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from ckpt_store import CheckpointStore
from ckpt_store.errors import DISK_FULL, failure_kind
from ckpt_store.export import read_array, read_values
from marind.testing.procs import kill_group, spawn
from marind.testing.small_fs import can_mount, fill, small_tmpfs
from marind.trainer.data import corpus

SPEC = """
[job]
name = "full-disk"
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
log_every = 1
[checkpoint]
url = "file://{ckpt}"
every_steps = 5
keep_last = 0
"""

pytestmark = pytest.mark.skipif(can_mount() is not None, reason=can_mount() or "")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 30)
    return str(prefix)


def _record(run_dir, rank: int) -> dict:
    try:
        return json.loads((run_dir / "progress" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(proc, what: str, cond, log_path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited ({proc.returncode}) before {what}: {log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout:g}s: {log_path.read_text()[-3000:]}")


@pytest.mark.slow            # long (two ranks, a full tmpfs); make chaos
def test_a_full_checkpoint_disk_never_stops_training_and_freed_space_saves_again(data, tmp_path):
    steps = 40
    vol = tmp_path / "vol"
    with small_tmpfs(vol, 24):
        ckpt = vol / "ckpt"
        spec_path = tmp_path / "run.toml"
        spec_path.write_text(SPEC.format(data=data, ckpt=ckpt, steps=steps))
        run_dir = tmp_path / "run"
        log_path = tmp_path / "out.log"
        with open(log_path, "wb") as log:
            proc = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "marind.trainer", str(spec_path)],
                         env={"MARIND_RUN_DIR": run_dir, "MARIND_JOB_ID": "job-full-disk"},
                         stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(proc, "a first commit", lambda: (_record(run_dir, 0).get("last_checkpoint_step") or 0) >= 5,
                  log_path)
            ballast = fill(vol)
            full_at = _record(run_dir, 0)
            # the volume stays full: saves fail, named, and the steps go on past them
            _wait(proc, "a failed save named in the progress record",
                  lambda: failure_kind(_record(run_dir, 0).get("checkpoint_error") or "") == DISK_FULL, log_path)
            reason = _record(run_dir, 0)["checkpoint_error"]
            assert "No space left on device" in reason and "keep_last" in reason, reason
            _wait(proc, "steps past two failed saves",
                  lambda: _record(run_dir, 0).get("step", 0) >= full_at["step"] + 12, log_path)
            assert _record(run_dir, 0)["last_checkpoint_step"] == full_at["last_checkpoint_step"] or \
                _record(run_dir, 0)["last_checkpoint_step"] <= full_at["step"] + 5
            stuck_at = _record(run_dir, 0)["last_checkpoint_step"]
            ballast.unlink()                       # space freed: the next saves commit
            rc = proc.wait(240)
        finally:
            kill_group(proc)
            proc.wait(30)
        out = log_path.read_text()
        assert rc == 0, out[-3000:]
        recs = [_record(run_dir, r) for r in (0, 1)]
        assert [r["step"] for r in recs] == [steps, steps] and all(r["phase"] == "done" for r in recs), recs
        assert '"kind": "disk_full"' in out and '"event": "checkpoint_failed"' in out
        # the failure was learned on both ranks (each logs it), for every failed step
        failed = [rec for line in out.splitlines() if '"event": "checkpoint_failed"' in line
                  for rec in _json_objects(line) if rec.get("event") == "checkpoint_failed"]
        by_step: dict[int, set] = {}
        for rec in failed:
            by_step.setdefault(rec["step"], set()).add(rec["rank"])
        assert by_step and all(ranks == {0, 1} for ranks in by_step.values()), by_step
        store = CheckpointStore(f"file://{ckpt}")
        committed = store.steps()
        assert committed[-1] == steps and any(s > stuck_at for s in committed), (committed, stuck_at)
        assert not set(by_step) & set(committed), (by_step, committed)     # a failed step never shows
        for step in committed:
            report = store.verify(step)
            assert report.ok, (step, report.problems)
        assert recs[0]["last_checkpoint_step"] == steps and "checkpoint_error" not in recs[0], recs[0]
        arrays = store.manifest(steps)["arrays"]     # the newest committed step loads, whole
        loaded = [read_array(store, steps, name, meta) for name, meta in arrays.items()]
        assert loaded and all(bool(torch.isfinite(t).all()) for t in loaded)
        assert read_values(store, steps)["extra"]["step"] == steps
        store.close()


def _json_objects(line: str) -> list[dict]:
    """Every JSON object in one log line: two ranks share the log, and one rank's line can land on
    the end of the other's unfinished one."""
    decoder, found, at = json.JSONDecoder(), [], line.find("{")
    while at != -1:
        try:
            obj, end = decoder.raw_decode(line, at)
        except ValueError:
            at = line.find("{", at + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        at = line.find("{", end)
    return found

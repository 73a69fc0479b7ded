"""The history checker on real checkpoints and a real etcd: a clean history passes, and each
invariant's breach is named, a mutant commit fence (a commit allowed after the lease ran out)
included."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckpt_store import CheckpointSaveFailed, CheckpointStore
from ckpt_store.save import commit as commit_module
from marind.control.events import append_event
from marind.core.lease_file import write_lease
from marind.testing.history import check, collect

JOB = "hist-1"


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((8, 4), float(step))}, "extra": {"step": step}}


def _save(store: CheckpointStore, step: int) -> None:
    store.save(step, _state(step), async_=False)


def _commit_event(client, step: int, node: str = "a") -> None:
    append_event(client, JOB, "checkpoint_committed", node, {"step": step})


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    write_lease(path, renewed_at=time.time(), ttl=30, node="a")
    return path


@pytest.fixture
def store(tmp_path, run_dir):
    s = CheckpointStore(f"file://{tmp_path}/ckpt", writer="thread", fence_file=str(run_dir / "lease.json"))
    yield s
    s.close()


def test_a_clean_history_holds_every_invariant(store, etcd_client):
    for step in (2, 4):
        _save(store, step)
        _commit_event(etcd_client, step)
    history = collect(etcd_client, JOB, store)
    assert history.steps == [2, 4] and history.seen_committed == [2, 4]
    assert history.manifests[4]["fence"]["node"] == "a"
    assert check(history, store, expect_state=None, expect_step=4) == []


def test_a_commit_allowed_after_the_lease_ran_out_is_caught(store, run_dir, etcd_client, monkeypatch):
    """The real fence refuses the commit; the mutant that allows it leaves a manifest the checker
    names."""
    write_lease(run_dir, renewed_at=time.time() - 60, ttl=30, node="a")      # ran out 48 s ago
    with pytest.raises(CheckpointSaveFailed, match="not committing"):
        _save(store, 2)
    assert store.steps() == []

    def mutant(fence, now=None, wait=True):        # the fence check that lets a stale world commit
        doc = json.loads(open(fence[0]).read())
        return {"valid_until": doc["valid_until"], "checked_at": time.time(), "margin_s": fence[1], "node": "a"}

    monkeypatch.setattr(commit_module, "check_fence", mutant)
    _save(store, 4)
    _commit_event(etcd_client, 4)
    problems = check(collect(etcd_client, JOB, store), store, expect_state=None)
    assert any("after its world's lease ran out" in p for p in problems), problems


def test_a_commit_by_a_node_declared_lost_is_caught_unless_it_joined_again(store, etcd_client):
    append_event(etcd_client, JOB, "node_lost", "b", {"node": "a", "cause": "host_silent"})
    time.sleep(0.01)
    _save(store, 2)
    problems = check(collect(etcd_client, JOB, store), store, expect_state=None)
    assert any("out of its world" in p for p in problems), problems
    append_event(etcd_client, JOB, "node_joined", "a", {})
    time.sleep(0.01)
    _save(store, 4)
    history = collect(etcd_client, JOB, store)
    problems = check(history, store, expect_state=None)
    assert [p for p in problems if "step 4" in p] == [], problems


def test_a_step_committed_twice_a_lost_checkpoint_and_a_corrupt_one_are_named(store, tmp_path, etcd_client):
    for step in (2, 4, 6):
        _save(store, step)
        _commit_event(etcd_client, step)
    _commit_event(etcd_client, 4, node="b")                       # a second world committed step 4
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000002")          # a committed checkpoint vanished
    obj = next(p for p in (tmp_path / "ckpt" / "step-0000000006" / "model" / "w").rglob("*")
               if p.is_file() and p.name != "zarr.json")
    obj.write_bytes(b"\0" * obj.stat().st_size)                    # and one rotted
    problems = check(collect(etcd_client, JOB, store), store, expect_state=None)
    assert any("step 4 was committed 2 times" in p for p in problems), problems
    assert any("[2] are gone" in p for p in problems), problems
    assert any("step 6 does not verify" in p for p in problems), problems
    # retention that drops step 2 explains its absence
    kept = collect(etcd_client, JOB, store, keep_last=2)
    assert not any("are gone" in p for p in check(kept, None, expect_state=None))


def test_retention_counts_the_newest_commits_that_no_event_reported(store, tmp_path, etcd_client):
    """The job ended before its agent reported its last commits: they are in the store, not in the
    events, and keep_last dropped the older reported ones for them (no violation); a reported step
    among the newest that is gone still is one."""
    for step in (2, 4, 6, 8):
        _save(store, step)
    for step in (2, 4, 6):                                       # 8 committed after the last report
        _commit_event(etcd_client, step)
    for step in (2, 4):                                          # retention's work (keep_last = 2)
        shutil.rmtree(tmp_path / "ckpt" / f"step-{step:010d}")
    history = collect(etcd_client, JOB, store, keep_last=2)
    assert history.steps[-2:] == [6, 8] and not any("are gone" in p for p in check(history, None, expect_state=None))
    history.steps = [8]                                          # 6, a newest and reported, gone
    assert any("[6] are gone" in p for p in check(history, None, expect_state=None))


def test_the_end_state_and_bit_identity(store, etcd_client):
    _save(store, 2)
    history = collect(etcd_client, JOB, store)
    problems = check(history, store, expect_state="SUCCEEDED", expect_step=4,
                     final_objects={"a": b"1"}, baseline_objects={"a": b"2"})
    assert any("ended None" in p for p in problems)
    assert any("expected 4" in p for p in problems)
    assert any("differs from the fault-free run" in p for p in problems)


@pytest.mark.unit
def test_the_faults_table_row_from_a_log_and_its_rendering(tmp_path):
    import subprocess
    import sys

    from marind.testing.history import History, append_row, fault_row, step_timeline
    log = tmp_path / "torchrun.log"
    lines = []
    for i, (t, step) in enumerate([(0, 1), (1, 2), (2, 3), (12, 2), (13, 3), (14, 4)]):
        lines.append(f'[rank0]: {{"event": "step", "step": {step}, "timestamp": "2026-01-01T00:00:{t:02d}Z", "i": {i}}}')
    log.write_text("\n".join(lines + ["noise"]))
    timeline = step_timeline([log])
    assert [s for _, s in timeline] == [1, 2, 3, 2, 3, 4]
    history = History(job="j", state={"state": "SUCCEEDED", "restarts": 1}, events=[], steps=[4], manifests={})
    row = fault_row("test_kill", history, timeline, [])
    assert row == {"scenario": "test_kill", "state": "SUCCEEDED", "restarts": 1, "recovery_s": 9.0,
                   "steps_lost": 2, "checkpoints_lost": 0, "violations": 0, "again_s": None}
    assert fault_row("test_cut", history, timeline, [], again_s=12.34)["again_s"] == 12.3
    rows = tmp_path / "faults.jsonl"
    append_row(rows, row)
    append_row(rows, dict(row, scenario="test_bad", violations=2))
    append_row(rows, dict(row, scenario="test_cut", again_s=12.3))
    tool = str(Path(__file__).resolve().parents[2] / "tools" / "faults_table.py")
    out = subprocess.run([sys.executable, tool, str(rows)], capture_output=True, text=True)
    assert out.returncode == 1                         # a row with violations fails the table
    assert "| test_kill | SUCCEEDED | 1 | 9.0 | - | 2 | 0 | 0 |" in out.stdout
    assert "| test_cut | SUCCEEDED | 1 | 9.0 | 12.3 | 2 | 0 | 0 |" in out.stdout
    missing = subprocess.run([sys.executable, tool, str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith("Error: cannot read")


@pytest.mark.unit
def test_steps_run_again_count_each_replica_groups_log_on_its_own_in_torchft(tmp_path):
    from marind.testing.history import merge_timelines, step_timeline, steps_run_again
    logs = []
    for node, (t0, steps) in {"a": (0, [1, 2, 3]), "b": (20, [1, 2, 3, 2, 3])}.items():
        log = tmp_path / f"{node}.log"
        log.write_text("\n".join(f'{{"event": "step", "step": {s}, "timestamp": "2026-01-01T00:00:{t0 + i:02d}Z"}}'
                                 for i, s in enumerate(steps)))
        logs.append(log)
    per_node = [step_timeline([log]) for log in logs]
    assert merge_timelines(per_node) == step_timeline(logs)
    assert steps_run_again(per_node, "torchft") == 2      # b's group ran 2 and 3 again; a's steps are no re-run
    assert steps_run_again(per_node, "elastic") == 5      # rank 0 on a, then on b: every repeat is a re-run

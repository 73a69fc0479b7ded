"""The progress record (marind.core.progress): the JSON on disk, written by the trainer, read by the agent."""

from __future__ import annotations

import json
import os

import pytest

from marind.core.progress import PHASES, ProgressRecord, ProgressWriter, read_record, read_records, record_path

pytestmark = pytest.mark.unit

CORE_KEYS = ["rank", "local_rank", "world_size", "pid", "step", "loss", "tokens_per_s", "last_checkpoint_step",
             "phase", "updated_at"]


def test_path_rule(tmp_path):
    assert record_path(tmp_path, 3) == tmp_path / "progress" / "rank-3.json"


def test_elastic_record_has_the_core_keys_only(tmp_path):
    w = ProgressWriter(2, 0, 4, tmp_path)
    w.update(phase="training", step=7, loss=1.5, tokens_per_s=10.0, last_checkpoint_step=5)
    on_disk = json.loads(record_path(tmp_path, 2).read_text())
    assert list(on_disk) == CORE_KEYS + ["phase_s"]
    assert on_disk["pid"] == os.getpid() and on_disk["step"] == 7 and on_disk["phase"] == "training"
    assert read_record(record_path(tmp_path, 2)) == w.record
    assert not list((tmp_path / "progress").glob(".*.tmp"))


def test_torchft_keys_appear_as_the_worker_learns_them(tmp_path):
    w = ProgressWriter(0, 0, 1, tmp_path)
    path = record_path(tmp_path, 0)
    w.update(replica_group=1)
    assert list(json.loads(path.read_text())) == CORE_KEYS + ["replica_group", "phase_s"]
    w.update(step=3, replica_group=1, participants=2, replica_rank=None, quorum_id=4, lighthouse_epoch=9,
             manager_rebuilds=0)
    on_disk = json.loads(path.read_text())
    assert list(on_disk) == CORE_KEYS + ["replica_group", "participants", "replica_rank", "quorum_id",
                                         "lighthouse_epoch", "manager_rebuilds", "phase_s"]
    assert on_disk["replica_rank"] is None and on_disk["lighthouse_epoch"] == 9
    w.update(phase="done", param_digest="ab12")
    on_disk = json.loads(path.read_text())
    assert list(on_disk)[-2:] == ["param_digest", "phase_s"]
    assert ProgressRecord.from_dict(on_disk) == w.record


def test_writer_checks_phase_and_field_names(tmp_path):
    w = ProgressWriter(0, 0, 1, None)           # no run dir: the record is kept in memory only
    for phase in PHASES:
        w.update(phase=phase)
    with pytest.raises(ValueError, match="unknown phase"):
        w.update(phase="sleeping")
    with pytest.raises(TypeError):
        w.update(no_such_field=1)
    assert not (tmp_path / "progress").exists()


def test_tolerant_read(tmp_path):
    d = tmp_path / "progress"
    d.mkdir()
    (d / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 11, "step": 5, "phase": "whatever"}))
    (d / "rank-1.json").write_text("{half written")
    (d / "rank-2.json").write_text(json.dumps([1, 2]))
    (d / "rank-3.json").write_text(json.dumps({"pid": 3}))
    (d / "rank-4.json").write_text(json.dumps({"rank": 4, "step": "many"}))
    records = read_records(tmp_path)
    assert [r.rank for r in records] == [0]
    r = records[0]
    assert (r.local_rank, r.world_size, r.loss, r.phase, r.replica_group) == (0, 0, None, "whatever", None)
    assert read_records(tmp_path / "nowhere") == []


def test_phase_times_add_up_to_the_process_time_and_a_tail_before_done_is_not_a_step(tmp_path, monkeypatch):
    clock = iter([100.0, 101.0, 101.5, 102.0, 102.25, 102.5, 104.0]).__next__
    monkeypatch.setattr("marind.core.progress.time.time", clock)
    w = ProgressWriter(0, 0, 1, tmp_path)                              # made at 100, starting
    w.update(phase="restoring")                                        # 101
    w.update(phase="training")                                         # 101.5
    w.update(step=1)                                                   # 102
    w.update(phase="checkpointing")                                    # 102.25
    w.update(phase="training")                                         # 102.5
    w.update(phase="done")                                             # 104: no step since 102.5
    assert w.record.phase_s == {"starting": 1.0, "restoring": 0.5, "training": 0.75, "checkpointing": 0.25,
                                "done": 1.5}
    assert sum(w.record.phase_s.values()) == w.record.updated_at - 100.0
    assert read_record(record_path(tmp_path, 0)).phase_s == w.record.phase_s
    on_disk = json.loads(record_path(tmp_path, 0).read_text())
    on_disk["phase_s"] = {"training": 2, "bogus": 1, "done": -1, "starting": True}     # read tolerantly
    assert ProgressRecord.from_dict(on_disk).phase_s == {"training": 2.0}

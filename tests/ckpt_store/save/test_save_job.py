"""SaveJob: the record a save hands its writer, and its JSON form for the writer process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ckpt_store.save.save_job import SaveJob, Slot, writer_kind

pytestmark = pytest.mark.unit


def _job(**kw) -> SaveJob:
    base = dict(step=7, dir="step-0000000007", rank=1, world=2, fmt=1, commit_timeout_s=30.0,
                values={"extra": {"epoch": 3}, "optim/0": [1, 2]},
                arrays={"model/w": {"shape": [4, 4], "dtype": "float32", "chunks": [2, 4], "inner_rows": None,
                                    "layout": {"mesh": [2]}}},
                saved_layout={"world_size": 2, "saved_at": "2026-01-01T00:00:00+00:00"})
    return SaveJob(**{**base, **kw})


def test_a_job_crosses_to_the_writer_process_as_json_unchanged():
    slots = [Slot(key="model/w/c/0/0", array="model/w", offset=0, nbytes=32, valid_rows=2),
             Slot(key="model/w/c/1/0", array="model/w", offset=64, nbytes=32, valid_rows=2)]
    job = _job(keep_last=3, keep_every=1000, background=True, background_nice=10).with_slots(slots, 1 << 20)
    wire = json.loads(json.dumps(job.to_json()))
    assert SaveJob.from_json(wire) == job
    assert job.slots == tuple(slots) and job.arena_size == 1 << 20
    assert job.layouts() == {"model/w": {"mesh": [2]}}


def test_a_job_is_frozen_and_with_slots_makes_a_new_one():
    job = _job()
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.step = 8  # type: ignore[misc]  # the point: a frozen record refuses it
    laid_out = job.with_slots([], 0)
    assert laid_out is not job and laid_out == job
    assert SaveJob.from_json(json.loads(json.dumps(job.to_json()))) == job


def test_a_job_with_a_value_that_is_not_json_is_refused_by_json_not_pickled():
    with pytest.raises(TypeError):
        json.dumps(_job(values={"bad": object()}).to_json())


def test_writer_kind():
    assert writer_kind("auto", False, {"key": "k"}) == "process"
    assert writer_kind("auto", False, None) == "process"
    assert writer_kind("auto", False, {"session": object()}) == "thread"     # not JSON: cannot cross
    assert writer_kind("auto", True, None) == "thread"                        # memory://
    assert writer_kind("thread", False, None) == "thread" and writer_kind("process", False, None) == "process"
    with pytest.raises(ValueError, match="memory://"):
        writer_kind("process", True, None)
    with pytest.raises(ValueError, match="writer='fork'"):
        writer_kind("fork", False, None)

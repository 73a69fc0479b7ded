"""A failed checkpoint save reaches ``status`` and ``events``: global rank 0's ``checkpoint_error``."""

from __future__ import annotations

import pytest

from marind.agent.progress import job_summary
from marind.control.jobs_client import row_reason
from marind.core.progress import ProgressRecord

pytestmark = pytest.mark.unit

FULL = ("checkpoint step 55 under file:///vol/ckpt did not commit: OSError: [Errno 28] No space left on device "
        "(the checkpoint volume is full: free space on it, or keep fewer checkpoints)")


def _record(**kw) -> ProgressRecord:
    base = dict(rank=0, local_rank=0, world_size=2, pid=1, step=57, loss=1.0, tokens_per_s=10.0,
                last_checkpoint_step=50, phase="training", updated_at=1.0)
    return ProgressRecord(**(base | kw))


def test_the_record_carries_the_failure_only_while_it_lasts():
    rec = _record(checkpoint_error=FULL)
    assert rec.to_dict()["checkpoint_error"] == FULL
    assert ProgressRecord.from_dict(rec.to_dict()) == rec
    assert "checkpoint_error" not in _record().to_dict()            # absent once a save committed
    assert job_summary([rec])["checkpoint_error"] == FULL
    assert "checkpoint_error" not in job_summary([_record()])


@pytest.mark.parametrize("state,expected", [
    ("RUNNING", FULL),                 # training goes on; status says why no checkpoint commits
    ("SUCCEEDED", FULL),               # ended, its last saves did not fit
    ("FAILED", "worker error line"),   # a worker's error wins where the job failed
    ("PENDING", "state reason"),
])
def test_status_reason_names_the_failed_save(state, expected):
    assert row_reason(state, "state reason", {"line": "worker error line"}, FULL) == expected
    assert row_reason("RUNNING", "state reason", None, None) == "state reason"

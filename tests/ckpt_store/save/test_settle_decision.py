"""The pure decisions behind a failed save: how the ranks settle the save in flight, and why it failed."""

from __future__ import annotations

import pytest

from ckpt_store.agreement import SETTLE_BUSY, SETTLE_FAILED, SETTLE_TIMEOUT, SETTLED, settle_decision
from ckpt_store.errors import (
    DISK_FULL,
    OTHER,
    STORAGE_THROTTLED,
    STORAGE_UNAVAILABLE,
    failure_kind,
    failure_reason,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("failed,running,busy,late,expected", [
    (False, False, False, False, SETTLED),          # over everywhere, committed
    (True, True, False, False, SETTLE_FAILED),      # one rank failed while another still waits: all stop
    (True, False, True, True, SETTLE_FAILED),       # a failure wins over giving up and timing out
    (False, True, False, False, None),              # still running, within bounds: compare again
    (False, True, True, False, SETTLE_BUSY),        # some rank gave up waiting: every rank skips
    (False, True, True, True, SETTLE_TIMEOUT),      # a timeout wins over giving up
    (False, False, True, True, SETTLED),            # over: late flags do not matter
])
def test_settle_decision(failed, running, busy, late, expected):
    assert settle_decision(failed, running, busy, late) == expected


@pytest.mark.parametrize("error,kind", [
    ("OSError: [Errno 28] No space left on device", DISK_FULL),
    ("rank 1: CheckpointSaveFailed: rank 1 failed to write its part: [Errno 122] Disk quota exceeded", DISK_FULL),
    ("An error occurred (SlowDown) when calling the PutObject operation (reached max retries: 7): "
     "Please reduce your request rate.", STORAGE_THROTTLED),
    ("OSError: [Errno 16] An error occurred (503) when calling the HeadObject operation", STORAGE_THROTTLED),
    ("Cannot connect to host 127.0.0.1:9 [Connection refused]", STORAGE_UNAVAILABLE),
    ("checkpoint step 500 did not commit: the snapshot copy failed: tensor changed", OTHER),
])
def test_failure_kind(error, kind):
    assert failure_kind(error) == kind


def test_a_full_disk_reason_names_the_step_the_volume_and_the_fix():
    kind, reason = failure_reason(55, "OSError: [Errno 28] No space left on device", "file:///vol/ckpt")
    assert kind == DISK_FULL
    assert "checkpoint step 55 under file:///vol/ckpt did not commit" in reason
    assert "volume is full" in reason and "keep_last" in reason
    assert failure_reason(3, "tensor changed")[1] == "checkpoint step 3 did not commit: tensor changed"

"""A full state dir, decided without processes (issue 32): when it counts as full, when space is
back, when to probe, whether a job may start, and what the node's record says."""

from __future__ import annotations

import errno

import pytest

from marind.agent.state_dir import (
    FULL_FREE_BYTES,
    PROBE_EVERY_S,
    RESUME_MAX_BYTES,
    RESUME_MIN_BYTES,
    Change,
    DirState,
    Look,
    WriteFailed,
    admit,
    condition,
    decide,
    describe,
    probe_due,
    resume_floor,
)
from marind.core.disk import Space, error_text, is_disk_full

pytestmark = pytest.mark.unit

GIB = 1 << 30
ROOMY = Space(free_bytes=10 * GIB, total_bytes=100 * GIB, free_inodes=1000)
EMPTY = Space(free_bytes=0, total_bytes=100 * GIB, free_inodes=1000)
ENOSPC = WriteFailed("torchrun output", "/s/jobs/j/logs/torchrun.log", "ENOSPC: No space left on device")


def test_the_errors_of_a_full_disk():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert not is_disk_full(ValueError("no"))
    assert not is_disk_full(None)
    assert error_text(OSError(errno.ENOSPC, "No space left on device")) == "ENOSPC: No space left on device"


def test_a_failed_write_makes_it_full_once_and_later_ones_only_add_what_was_dropped():
    v = decide(DirState(free_bytes=5 * GIB), ENOSPC, now=100.0)
    assert v.change == Change.FULL and v.state.full and v.state.since == 100.0
    assert "torchrun output" in v.reason and "ENOSPC" in v.reason
    assert v.state.error == ENOSPC.error and v.state.where == ENOSPC.path
    v2 = decide(v.state, WriteFailed("lease.json", "/s/jobs/j/lease.json", "ENOSPC: ..."), now=101.0)
    assert v2.change == Change.NONE and v2.state.since == 100.0          # announced once
    assert v2.state.dropped == ("torchrun output", "lease.json")
    assert decide(v2.state, ENOSPC, now=102.0).state.dropped == ("torchrun output", "lease.json")


def test_a_look_with_almost_nothing_left_or_no_inode_is_full():
    v = decide(DirState(), Look(Space(FULL_FREE_BYTES - 1, 100 * GIB, 1000)), now=5.0)
    assert v.change == Change.FULL and v.reason == "under 1.0 MiB free" and v.state.free_bytes == FULL_FREE_BYTES - 1
    v = decide(DirState(), Look(Space(10 * GIB, 100 * GIB, 0)), now=5.0)
    assert v.change == Change.FULL and "inode" in v.reason
    v = decide(DirState(), Look(Space(FULL_FREE_BYTES, 100 * GIB, None)), now=5.0)     # no inode count: fine
    assert v.change == Change.NONE and not v.state.full and v.state.free_bytes == FULL_FREE_BYTES


def test_space_is_back_only_with_room_and_a_probe_write_that_went_through():
    full = decide(DirState(), Look(EMPTY), now=0.0).state
    assert decide(full, Look(ROOMY), now=10.0).change == Change.NONE                   # no probe: not yet
    assert decide(full, Look(ROOMY, probe_ok=False), now=10.0).change == Change.NONE   # a quota statvfs does not show
    small = Space(resume_floor(100 * GIB) - 1, 100 * GIB, 1000)
    assert decide(full, Look(small, probe_ok=True), now=10.0).change == Change.NONE    # under the floor: no flapping
    v = decide(full, Look(ROOMY, probe_ok=True), now=10.0)
    assert v.change == Change.RECOVERED and v.state == DirState(free_bytes=ROOMY.free_bytes)
    assert decide(DirState(), Look(None), now=1.0).change == Change.NONE               # statvfs failed: nothing known


def test_the_resume_floor_is_one_percent_within_bounds():
    assert resume_floor(0) == RESUME_MIN_BYTES
    assert resume_floor(100 << 20) == RESUME_MIN_BYTES
    assert resume_floor(1000 * GIB) == RESUME_MAX_BYTES
    assert resume_floor(10 * GIB) == 10 * GIB // 100


def test_probes_only_while_full_with_room_at_most_every_few_seconds():
    assert not probe_due(DirState(), ROOMY, now=100.0)
    full = decide(DirState(), ENOSPC, now=100.0).state
    assert not probe_due(full, ROOMY, now=100.0 + PROBE_EVERY_S / 2)
    assert not probe_due(full, EMPTY, now=200.0)
    assert not probe_due(full, None, now=200.0)
    assert probe_due(full, ROOMY, now=100.0 + PROBE_EVERY_S)
    after = decide(full, Look(ROOMY, probe_ok=False), now=150.0).state
    assert after.probed_at == 150.0 and not probe_due(after, ROOMY, now=151.0)


def test_no_job_starts_on_a_full_state_dir_and_the_record_says_why():
    assert admit(DirState(), "/s") == (True, "")
    assert condition(DirState(), "/s") is None and describe(DirState(), "/s") == ""
    full = decide(DirState(free_bytes=123), ENOSPC, now=7.0).state
    ok, why = admit(full, "/s")
    assert not ok and why.startswith("not started on this node: state dir /s is full") and "fix:" in why
    rec = condition(full, "/s")
    assert rec == {"path": "/s", "since": 7.0, "error": ENOSPC.error, "free_bytes": 123,
                   "reason": describe(full, "/s")}
    assert "123 B free" in rec["reason"]


class _Outbox:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []
        self.writes = 0

    def event(self, job, kind, detail):
        self.events.append((job, kind, detail))

    def put(self, job, action):
        self.writes += 1
        action()


class _Registry:
    def __init__(self):
        self.record: dict = {}
        self.published: list[dict] = []

    def set_condition(self, name, value):
        if value is None:
            self.record.pop(name, None)
        else:
            self.record[name] = value

    def publish(self):
        self.published.append(dict(self.record))


class _Link:
    def __init__(self):
        self.outbox, self.registry = _Outbox(), _Registry()


def test_the_watch_announces_each_change_once_and_holds_new_jobs_back(tmp_path, monkeypatch):
    import marind.agent.state_dir_watch as W
    from marind.agent.metrics import Metrics
    from marind.control.events import STATE_DIR_FULL, STATE_DIR_RECOVERED

    space = {"now": ROOMY}
    monkeypatch.setattr(W, "free_space", lambda path: space["now"])
    metrics, link = Metrics(), _Link()
    watch = W.StateDirWatch(tmp_path, node="n", metrics=metrics, clock=lambda: 10.0)
    watch.tick(10.0, ["j1"], link)
    assert not watch.full and link.outbox.events == [] and metrics.value("marind_state_dir_full") == 0
    assert watch.note("torchrun output", tmp_path / "x.log", OSError(errno.ENOSPC, "No space left on device"))
    assert not watch.note("curves", tmp_path / "x", OSError(errno.EIO, "I/O error"))   # not a full disk
    watch.note("lease.json", tmp_path / "lease.json", OSError(errno.EDQUOT, "Disk quota exceeded"))
    space["now"] = EMPTY
    for t in (10.5, 11.0, 11.5):
        watch.tick(t, ["j1"], link)
    assert [(j, k) for j, k, _ in link.outbox.events] == [("j1", STATE_DIR_FULL)]     # once, not per tick
    detail = link.outbox.events[0][2]
    assert detail["path"] == str(tmp_path) and "ENOSPC" in detail["error"] and detail["effect"]
    assert link.registry.published[-1]["state_dir_full"]["path"] == str(tmp_path)
    assert metrics.value("marind_state_dir_full") == 1 and metrics.value("marind_state_dir_free_bytes") == 0
    assert not watch.may_start("j2", link.outbox) and not watch.may_start("j2", link.outbox)
    assert [(j, k) for j, k, _ in link.outbox.events][1:] == [("j2", STATE_DIR_FULL)]
    assert "not started" in link.outbox.events[1][2]["action"]
    space["now"] = ROOMY                                  # room again: the probe write (a real one) decides
    watch.tick(11.5 + PROBE_EVERY_S, ["j1"], link)
    back = [(j, k) for j, k, _ in link.outbox.events if k == STATE_DIR_RECOVERED]
    assert back == [("j1", STATE_DIR_RECOVERED), ("j2", STATE_DIR_RECOVERED)]
    recovered = link.outbox.events[-1][2]
    assert recovered["dropped"] == ["torchrun output", "lease.json"] and recovered["full_s"] == 3.5
    assert "state_dir_full" not in link.registry.published[-1] and metrics.value("marind_state_dir_full") == 0
    assert watch.may_start("j2", link.outbox) and not list(tmp_path.glob(".space-probe*"))

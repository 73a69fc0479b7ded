"""`submit --wait`'s step cell and `status`'s fix lines (pure)."""

from __future__ import annotations

import pytest

from marind.commands.events import format_detail
from marind.commands.jobs import fix_lines, step_cell

pytestmark = pytest.mark.unit


def test_step_cell_without_a_declared_step_count():
    assert step_cell(100, 1000) == "100/1000"
    assert step_cell(100, None) == "100"          # not "100/None": the program declares no step count
    assert step_cell(None, None) == "-" and step_cell(None, 10) == "-/10"


def test_fix_lines_for_failing_jobs_with_a_known_cause():
    jobs = [{"id": "a", "state": "FAILED", "last_error": {"cause": "oom_killed", "fix": "give it more memory"}},
            {"id": "b", "state": "RUNNING", "last_error": {"cause": "killed", "fix": "find the sender"}},
            {"id": "c", "state": "RESTARTING", "last_error": {"line": "an old record without a cause"}},
            {"id": "d", "state": "RESTARTING", "last_error": None}]
    assert fix_lines(jobs) == ["", "a: oom_killed: fix: give it more memory"]
    assert fix_lines(jobs[1:]) == []


def test_an_events_line_does_not_repeat_the_fix_its_reason_ends_with():
    detail = {"cause": "killed", "rank": 1, "fix": "find the sender",
              "reason": "rank 1 (local 1) on a was killed by SIGKILL; fix: find the sender"}
    assert format_detail(detail) == ("cause=killed rank=1 "
                                     "reason=rank 1 (local 1) on a was killed by SIGKILL; fix: find the sender")
    assert format_detail({"fix": "other", "reason": "x"}) == "fix=other reason=x"

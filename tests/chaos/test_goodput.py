"""bench/goodput.py: its accounting (pure) and, in full runs, the --quick shape end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.goodput import StepLine, kept_step_seconds, parse_step_lines, percentile, phase_split
from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.unit
def test_kept_steps_are_the_last_run_of_each_step_within_the_window():
    lines = [StepLine(10, 1, 1.0), StepLine(11, 2, 1.0), StepLine(12, 3, 1.0),   # 2, 3 lost to a kill
             StepLine(20, 2, 0.5), StepLine(21, 3, 0.5), StepLine(22, 4, 0.5),   # replayed after restore
             StepLine(99, 5, 7.0)]                                                # after the window
    assert kept_step_seconds(lines, start=0, end=30) == (1.0 + 0.5 * 3, 4)


@pytest.mark.unit
def test_phase_split_is_consecutive_and_sums_to_the_total():
    marks = {"detection": 1.0, "rendezvous": 3.0, "restart": 8.0, "restore": 9.0, "first_step": 9.5}
    split = phase_split(marks, t_kill=0.5)
    assert split == {"detection": 0.5, "rendezvous": 2.0, "restart": 5.0, "restore": 1.0,
                     "first_step": 0.5, "total": 9.0}
    assert phase_split({"detection": 1.0}, 0.0) is None


@pytest.mark.unit
def test_percentile_and_step_line_parsing():
    assert percentile([], 0.5) is None
    assert percentile([3, 1, 2], 0.5) == 2 and percentile([1, 2, 3, 4], 0.95) == pytest.approx(3.85)
    text = ('noise\n[default0]:{"logger": "trainer", "step": 7, "loss": 5.1, "step_s": 0.25, '
            '"event": "step", "rank": 0, "timestamp": "2026-12-03T07:37:41.088311Z"}\n'
            '{"event": "restored", "step": 5, "timestamp": "2026-12-03T07:37:40Z"}\n')
    [line] = parse_step_lines(text)
    assert line.step == 7 and line.step_s == 0.25 and line.at == pytest.approx(1796283461.088311)


@pytest.mark.slow
def test_quick_goodput_run_has_the_promised_shape():
    res = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "goodput.py"), "--quick"],
                         env=base_env(), capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "goodput"
    base, el = doc["baseline"], doc["elastic"]
    assert base["failures"] == [] and base["steps_kept"] > 0 and 0 < base["goodput"] <= 1
    assert el["summary"]["failures"] == 1 == el["summary"]["recovered"]
    [failure] = el["failures"]
    assert failure["lost_steps"] >= 0 and failure["recovery_s"]["total"] > 0
    assert set(el["summary"]["recovery_s"]) == {"detection", "rendezvous", "restart", "restore",
                                                "first_step", "total"}
    assert "elastic_goodput_over_baseline" in doc["ratios"] and "goodput_met" in doc["floors"]

"""bench/goodput.py and bench/goodput_common.py: the accounting (pure) and, in full runs, the --quick shape
end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.goodput import phase_split
from bench.goodput_common import StepLine, kept_step_seconds, ledger_check, parse_step_lines, percentile
from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.unit
def test_kept_steps_are_the_last_run_of_each_step_within_the_window():
    lines = [StepLine(10, 1, 1.0), StepLine(11, 2, 1.0), StepLine(12, 3, 1.0),   # 2, 3 lost to a kill
             StepLine(20, 2, 0.5), StepLine(21, 3, 0.5), StepLine(22, 4, 0.5),   # replayed after restore
             StepLine(99, 5, 7.0)]                                                # after the window
    assert kept_step_seconds(lines, start=0, end=30) == (1.0 + 0.5 * 3, 4)
    saved = [StepLine(10, 1, 1.0), StepLine(11, 2, 1.5, save_s=0.4)]                 # a snapshot blocked step 2
    assert kept_step_seconds(saved, start=0, end=30) == (pytest.approx(2.1), 2)


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
            '{"event": "restored", "step": 5, "timestamp": "2026-12-03T07:37:40Z"}\n'
            '{"step": 8, "step_s": 0.5, "save_s": 0.2, "event": "step", "timestamp": "2026-12-03T07:37:42Z"}\n')
    line, saved = parse_step_lines(text)
    assert line.step == 7 and line.step_s == 0.25 and line.at == pytest.approx(1796283461.088311)
    assert line.save_s == 0.0 and saved.save_s == 0.2


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
    # marind's own ledger beside the outside figure: its parts add up, its causes name the kill
    for run in (base, el):
        assert run["ledger_check"]["readable"] and abs(run["ledger_check"]["parts_minus_wall_s"]) < 1.0, run["ledger"]
        assert 0 < run["ledger_check"]["outside_goodput"] <= 1
    assert el["ledger"]["seconds"]["detection"] > 0 and el["ledger"]["final"]


@pytest.mark.unit
def test_ledger_check_compares_the_parts_and_the_goodputs_over_the_ledgers_window():
    ledger = {"start": 100.0, "end": 110.0, "wall_s": 10.0, "seconds": {"training": 7.0, "checkpoint": 1.0,
                                                                         "detection": 2.0}, "goodput": 0.7}
    lines = [StepLine(99, 1, 5.0),                                            # before the window
             StepLine(102, 1, 2.0), StepLine(104, 2, 2.0, save_s=0.5),       # a save blocked step 2
             StepLine(106, 3, 2.0), StepLine(108, 3, 1.5), StepLine(111, 4, 9.0)]   # 3 again; 4 after the end
    check = ledger_check(ledger, lines)
    assert check == {"readable": True, "parts_minus_wall_s": 0.0, "outside_goodput": 0.55,
                     "goodput_minus_outside": 0.15}       # (2 + 1.5 + 2) / 10: step 3's rerun is recompute
    assert ledger_check({"error": "x"}, lines) == {"readable": False}


@pytest.mark.unit
def test_the_rank0_node_is_the_one_with_the_freshest_rank0_record(tmp_path):
    from marind.testing.bench_sites import rank0_node
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d, at in zip(dirs, (5.0, 9.0, None)):
        (d / "progress").mkdir(parents=True)
        if at is not None:
            (d / "progress" / "rank-0.json").write_text(json.dumps({"rank": 0, "updated_at": at}))
    assert rank0_node(["a", "b", "c"], dirs) == "b"        # a's record is from an earlier round
    (dirs[0] / "progress" / "rank-0.json").write_text("{torn")
    assert rank0_node(["a", "b", "c"], dirs) == "b"


@pytest.mark.unit
def test_bed_result_puts_the_power_off_floor_at_the_kill_p50_plus_the_lease_ttl():
    import argparse

    from bench.goodput import bed_result, summarize
    from marind.testing.chaos.schedule import draw_schedule

    def run(goodput: float, total: float) -> dict:
        split = {"detection": total - 1, "rendezvous": 0.25, "restart": 0.25, "restore": 0.25,
                 "first_step": 0.25, "total": total}
        r = {"goodput": goodput, "goodput_steady": goodput,
             "failures": [{"lost_steps": 1, "recovery_s": split}]}
        r["summary"] = summarize(r)
        return r

    args = argparse.Namespace(quick=True, wall=90.0, every=50.0, fixed=True, seed=7, nodes=2, nproc=2,
                              ckpt_every=5, fault="both", back_after=20.0, mode="both")
    draws = draw_schedule(7, 50.0, 90.0, fixed=True, max_actions=1)
    doc = bed_result(args, draws, {"goodput": 0.95}, {"kill": run(0.9, 4.0), "power_off": run(0.86, 17.0)})
    assert doc["site"] == "bed" and doc["config"]["lease_ttl_s"] == 10
    assert doc["recovery_p50_s"] == {"kill": 4.0, "power_off": 17.0}
    assert doc["floors"]["power_off_recovery_p50_max_s"] == 16.0
    assert doc["floors"]["power_off_recovery_p50_met"] is False
    assert doc["floors"]["kill_goodput_met"] and doc["floors"]["power_off_goodput_met"]
    assert doc["ratios"] == {"kill_goodput_over_baseline": round(0.9 / 0.95, 4),
                             "power_off_goodput_over_baseline": round(0.86 / 0.95, 4)}
    only = bed_result(args, draws, {"goodput": 0.95}, {"power_off": run(0.86, 17.0)})
    assert "power_off_recovery_p50_max_s" not in only["floors"]
    ft = {"goodput": 0.9, "failures": [{"lost_steps": 0}]}
    both = bed_result(args, draws, {"goodput": 0.95}, {"power_off": run(0.86, 17.0)},
                      {"power_off": ft, "kill": {"goodput": 0.8, "failures": [{"lost_steps": 2}]}})
    assert both["floors"]["torchft_power_off_goodput_above_elastic"] is True
    assert both["floors"]["torchft_power_off_survivors_lose_no_steps"] is True
    assert both["floors"]["torchft_kill_survivors_lose_no_steps"] is False
    assert "torchft_kill_goodput_above_elastic" not in both["floors"]     # no elastic kill run to compare
    assert both["ratios"]["torchft_power_off_goodput_over_elastic"] == round(0.9 / 0.86, 4)
    assert set(both["faults_torchft"]) == {"power_off", "kill"}


@pytest.mark.slow
@pytest.mark.hosts
def test_quick_torchft_goodput_on_the_bed_survives_a_power_off():
    from tests.hosts.conftest import require_bed
    require_bed()
    res = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "goodput.py"), "--quick", "--fault", "power_off",
                          "--mode", "torchft"], env=base_env(), capture_output=True, text=True, timeout=900,
                         cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["mode"] == "torchft" and doc["faults"] == {} and set(doc["faults_torchft"]) == {"power_off"}
    (failure,) = doc["faults_torchft"]["power_off"]["failures"]
    assert failure["fault"] == "power_off" and failure["victim"]
    assert failure["survivor_steps"] > 0, failure          # the other group trained through the outage
    assert failure["rejoin_s"] is not None, failure        # the rebooted host's group came back
    assert doc["floors"]["torchft_power_off_survivors_lose_no_steps"], failure


@pytest.mark.slow
@pytest.mark.hosts
def test_quick_goodput_on_the_bed_reports_both_fault_kinds():
    from tests.hosts.conftest import require_bed
    require_bed()
    res = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "goodput.py"), "--quick", "--fault", "both"],
                         env=base_env(), capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "goodput" and doc["site"] == "bed" and set(doc["faults"]) == {"kill", "power_off"}
    for kind, run in doc["faults"].items():
        assert run["summary"]["failures"] == 1 == run["summary"]["recovered"], (kind, run["failures"])
        assert run["failures"][0]["recovery_s"]["total"] > 0
    assert "power_off_recovery_p50_met" in doc["floors"]

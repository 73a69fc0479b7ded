"""bench/train_bench.py --quick prints one JSON object of the documented shape (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.parametrize("sections", [pytest.param(None, marks=pytest.mark.slow),
                                      pytest.param("layouts", marks=pytest.mark.slow)],
                         ids=["all", "layouts"])     # CI's 40 minutes: both in make chaos
def test_train_bench_quick_shape(sections):
    argv = ["--quick"] + (["--sections", sections] if sections else [])
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "train_bench.py"), *argv],
                          env=base_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "train" and out["quick"] is True
    if sections is None:
        row = out["throughput"][0]
        assert {"preset", "ranks", "tokens_per_s", "mfu", "memory_bytes_rank0"} <= set(row)
        ck = out["checkpoint_overhead"][0]
        assert {"baseline_tokens_per_s", "marind_tokens_per_s", "overhead_pct", "every_steps"} <= set(ck)
        assert isinstance(out["floor"]["ok"], bool)
    else:
        assert out["sections"] == ["layouts"] and out["throughput"] == [] and out["checkpoint_overhead"] == []
    fsdp, pp = out["layouts"]
    assert fsdp["layout"] == "fsdp" and pp["layout"] == "pp" and pp["pp"] == 2
    assert {"tokens_per_s", "memory_bytes_rank0", "bubble_fraction"} <= set(pp)
    assert 0 < pp["bubble_fraction"] < 1 and fsdp["bubble_fraction"] == 0
    # measured per rank (busy vs wall of the schedule runs), beside the schedule's figure
    assert len(pp["bubble_measured"]) == 2 and all(0 <= b < 1 for b in pp["bubble_measured"])
    assert pp["bubble_measured_mean"] == pytest.approx(sum(pp["bubble_measured"]) / 2, abs=1e-3)
    assert "bubble_measured" not in fsdp
    dense, moe = out["moe"]   # --quick: the ep=2 row and its dense twin of the same active parameters
    assert dense["layout"] == "dense-fsdp" and moe["layout"] == "moe-ep2"
    assert abs(dense["active_params"] - moe["active_params"]) <= 0.01 * moe["active_params"]
    assert moe["total_params"] > moe["active_params"] and "router" not in dense
    assert {"tokens_per_s", "memory_bytes_rank0"} <= set(moe)
    for row in (fsdp, pp, dense, moe):   # every rank's own peak memory (and before the first step)
        peaks = row["peak_memory_bytes"]
        assert len(peaks) == 2 and all(p > 0 for p in peaks), row["layout"]
        assert row["peak_memory_bytes_max"] == max(peaks) and row["peak_memory_bytes_min"] == min(peaks)
        assert all(0 < s <= p for s, p in zip(row["setup_peak_memory_bytes"], peaks))
    r = moe["router"]
    assert 0 <= r["load_min"] <= 1 <= r["load_max"] and r["dropped"] == 0 and r["balance_loss"] > 0
    assert sum(r["tokens_per_expert_last"]) > 0

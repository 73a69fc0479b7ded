"""bench/scale.py --quick runs 16 simulated nodes and prints the documented JSON shape (no timings checked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.scale import FIGURES, exponents
from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.unit
def test_exponents_are_per_figure_and_none_without_two_sizes():
    rows = {"4": {"nodes": 4, "rendezvous_s": 1.0, "c10d_rendezvous_s": None},
            "16": {"nodes": 16, "rendezvous_s": 4.0, "c10d_rendezvous_s": 2.0}}
    got = exponents(rows)
    assert set(got) == set(FIGURES)
    assert got["rendezvous_s"] == 1.0 and got["c10d_rendezvous_s"] is None


def test_scale_quick_prints_one_json_object():
    out = subprocess.run([sys.executable, "bench/scale.py", "--quick", "--no-s3"], cwd=REPO_ROOT,
                         env=base_env({"MARIND_LOG_LEVEL": "ERROR"}), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "scale" and result["mode"] == "quick"
    row = result["nodes"]["16"]
    assert "error" not in row and not row["notes"], row
    for figure in FIGURES:
        assert isinstance(row[figure], (int, float)) and row[figure] > 0, (figure, row)
    assert set(result["exponents"]) == set(FIGURES)
    for ranks in ("16", "64"):
        commit = result["commit"][ranks]
        assert commit["rank0_storage_calls"] > int(ranks) and commit["commit_s"] > 0, commit
        assert commit["load_list_reads"] == int(ranks) + 1, commit     # every object list, and the manifest

"""The checkpoint scale benchmark runs in --quick mode and prints its JSON shape (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.ckpt_scale import FIGURES, slope
from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.unit
def test_slope_is_the_log_log_growth_exponent():
    assert slope([100, 1000, 10000], [0.1, 1.0, 10.0]) == 1.0
    assert slope([1, 2, 4, 8], [3.0, 3.0, 3.0, 3.0]) == 0.0
    assert slope([1, 4], [1.0, 2.0]) == 0.5
    assert slope([10], [1.0]) is None and slope([1, 2], [1.0, 0.0]) is None


@pytest.mark.slow
def test_ckpt_scale_quick_prints_one_json_object():
    out = subprocess.run([sys.executable, "bench/ckpt_scale.py", "--quick"], cwd=REPO_ROOT,
                         env=_as_documented(), capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "ckpt_scale" and result["quick"] is True
    for sweep, by in (("arrays_sweep", "arrays"), ("ranks_sweep", "world")):
        points = result[sweep]["points"]
        assert len(points) >= 2 and len({p[by] for p in points}) == len(points), points
        for p in points:
            assert all(p[f] > 0 for f in FIGURES), p
            assert p["objects"] >= p["arrays"] * p["world"], p   # gathering off: an object per array and rank
    for by in ("arrays", "ranks"):
        assert set(result["exponents"][by]) == set(FIGURES)
        assert all(isinstance(v, float) for v in result["exponents"][by].values()), result["exponents"]
        assert result["floor_save_exponent_le_1_1"][by] in (True, False)
    assert result["store_options"] == {"gather_small_bytes": 0}


def test_ckpt_scale_refuses_bad_input_with_exit_2():
    out = subprocess.run([sys.executable, "bench/ckpt_scale.py", "--arrays-world", "0"], cwd=REPO_ROOT,
                         env=base_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--arrays-world" in out.stderr


def _as_documented() -> dict[str, str]:
    """The bench as README runs it, ``python bench/NAME.py`` from the repo root: no PYTHONPATH
    (only the installed ``marind`` and ``ckpt_store`` are importable, not ``bench``)."""
    env = base_env({"MARIND_LOG_LEVEL": "WARNING"})
    env.pop("PYTHONPATH", None)
    return env

"""bench/straggler_bench.py --quick prints one JSON object of the documented shape (no timing checks).

Three jobs under real agents on this machine: the healthy pair, the pair with a slowed third node
(named only), and the same with ``straggler_action = "exclude"`` (the slowed node taken out).
Slow (three runs of the trainer): ``make chaos``; its figures are in docs/perf.md. CI has the
exclusion under real agents (``test_straggler_exclusion.py``) and the decision (``test_stragglers.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing.procs import REPO_ROOT, base_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_straggler_bench_quick_shape():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "straggler_bench.py"), "--quick"],
                          env=base_env(), capture_output=True, text=True, timeout=840, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["bench"], out["quick"]) == ("straggler", True)
    for key in ("healthy_steps_per_s", "straggler_steps_per_s", "excluded_steps_per_s", "named_after_s",
                "excluded_after_s", "training_again_after_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["named"]["node"] == out["excluded"]["node"] == "c"
    assert out["node_left"] == [{"by": out["node_left"][0]["by"], "reason": "excluded as a straggler"}]
    assert set(out["ratios"]) == {"straggler_over_healthy", "excluded_over_healthy"}
    assert {"named_met", "excluded_over_healthy_met"} <= set(out["floors"])

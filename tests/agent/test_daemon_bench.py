"""bench/daemon_bench.py --quick prints one JSON object with the promised shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.slow
def test_quick_bench_shape():
    res = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "daemon_bench.py"), "--quick"],
                         env=base_env(), capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "daemon"
    assert set(doc["throughput"]) >= {"torchrun_tokens_per_s", "marind_tokens_per_s", "ratio", "floor"}
    assert "marind_over_torchrun_tokens_per_s" in doc["ratios"]

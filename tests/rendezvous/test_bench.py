"""bench/rendezvous_bench.py --quick runs and prints the documented JSON shape (no timings checked)."""

from __future__ import annotations

import json
import subprocess
import sys

from marind.testing.procs import REPO_ROOT, base_env


def test_quick_bench_prints_one_json_object_last():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "rendezvous_bench.py"), "--quick"],
                          capture_output=True, text=True, timeout=180, env=base_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "rendezvous" and result["mode"] == "quick"
    assert result["agents"] == [2, 4]
    for backend in ("etcd3", "c10d"):
        for n in ("2", "4"):
            entry = result[backend][n]
            assert entry["median_s"] > 0 and len(entry["runs_s"]) == 1
    assert set(result["ratios"]) == {"etcd3_over_c10d_2", "etcd3_over_c10d_4"}

"""bench/page_bench.py --quick prints one JSON object of the documented shape (no timing checks).

The bench loads the job page in headless chromium (issue 35: the cluster page of 100 jobs
renders in under 2 s in the browser); its figures are in docs/perf.md, "The job page".
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing import browser
from marind.testing.procs import REPO_ROOT, base_env

pytestmark = pytest.mark.skipif(browser.CHROMIUM is None, reason=browser.SKIP_REASON)


def test_page_bench_quick_shape():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "page_bench.py"), "--quick"],
                          env=base_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["bench"], out["quick"], out["jobs"], out["repeats"]) == ("page", True, 10, 1)
    for key in ("cluster_page_100_jobs_s", "job_page_s", "empty_page_s"):
        assert isinstance(out[key], float), key
    for part in ("wall_s", "in_page_s"):
        assert set(out[part]) == {"empty", "cluster", "job"} and all(v > 0 for v in out[part].values()), part
    assert set(out["served_s"]) == {"cluster", "job"} and all(v > 0 for v in out["page_bytes"].values())
    assert out["empty_page_s"] == out["wall_s"]["empty"] and len(out["runs_wall_s"]["cluster"]) == 1
    assert out["job_page"]["job"] == "long-run" and out["job_page"]["series_points"] > 10
    assert out["job_page"]["events"] > 10 and sum(out["states"].values()) == 10
    assert all(out["states"][s] >= 1 for s in ("SUCCEEDED", "FAILED", "CANCELLED", "RUNNING", "RESTARTING", "PENDING"))

"""The checkpoint benchmark runs in --quick mode and prints its JSON shape (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing.procs import REPO_ROOT, base_env


@pytest.mark.slow     # 64 s of CI's 40 minutes: make chaos runs it
def test_ckpt_bench_quick_prints_one_json_object():
    out = subprocess.run([sys.executable, "bench/ckpt_bench.py", "--quick"], cwd=REPO_ROOT,
                         env=_as_documented(), capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "ckpt" and result["world"] == 4
    for target in ("local", "s3"):
        for who in ("marind", "dcp"):
            for key in ("sync_save_s", "async_blocked_s", "async_commit_s", "load_s", "step_during_save_s"):
                assert key in result[target][who], (target, who, key)
    for target in ("local", "s3"):   # bytes, not time: the quick state's arrays are all small, so all
        # gathered and written whole; each rank still reads only its own rows of them
        assert result[target]["marind"]["read_amplification"] <= 1.1, result[target]["marind"]
    assert {"marind_load_s", "dcp_load_s", "marind_read_amplification"} <= set(result["reshard_4_to_2_local"])
    # the eviction's check: the bytes of the target's files still cached as each cold load began
    assert result["reshard_4_to_2_local"]["cold_resident_bytes"] >= 0
    assert all(result["local"][who]["cold_resident_bytes"] >= 0 for who in ("marind", "dcp"))
    assert result["disk_write_MBps"] > 0 and "sync_save_vs_dcp" in result["ratios"]["local"]
    assert result["disk_read_MBps"] > 0 and "local_load_vs_raw_disk_read" in result["ratios"]
    for who in ("marind", "dcp"):   # local loads: from the disk (cache dropped) and again from memory
        times = result["local"][who]
        assert len(times["load_all_s"]) == len(times["load_warm_all_s"]) == result["repeats"], times
    assert result["s3"]["marind"]["load_warm_s"] is None, "an S3 load is timed as found"
    for target in ("local", "s3"):   # the ranks' writer processes did the background work
        # (the quick state's saves may cost a writer less than one clock tick: >= 0, not None)
        assert result[target]["marind"]["writer_cpu_during_async_s"] >= 0, result[target]["marind"]
    assert "step_slowdown_from_server_alone" in result["ratios"]["s3"]
    for target in ("local", "s3"):   # DCP's best async mode, named, beside the thread-based one
        assert result[target]["dcp_process"]["async_commit_s"] > 0, result[target]
        assert "async_commit_vs_dcp_process" in result["ratios"][target]
    slow = result["slow_target"]
    if "error" not in slow:   # root here: the throttled loop target ran beside the machine's disk, and is gone
        assert slow["throttle"] and slow["disk_write_MBps"] > 0, slow
        for who in ("marind", "dcp", "dcp_process"):
            assert result["slow"][who]["async_commit_s"] > 0, result["slow"]
        assert {"sync_save_vs_dcp", "load_vs_dcp", "reshard_load_vs_dcp"} <= set(result["ratios"]["slow"])
        assert slow["device"] not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    else:
        assert result["slow"] is None and slow["error"]


@pytest.mark.slow
def test_ckpt_bench_sections_reshard_times_the_reshard_loads_only():
    """``--sections reshard``: one untimed save of each system, then only the 4 -> 2 loads."""
    out = subprocess.run([sys.executable, "bench/ckpt_bench.py", "--quick", "--sections", "reshard", "--no-slow"],
                         cwd=REPO_ROOT, env=_as_documented(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sections"] == ["reshard"] and result["s3"] is None, result
    assert "sync_save_s" not in result["local"]["marind"] and "load_s" not in result["local"]["marind"]
    assert result["torch_save_s"] is None and "disk_write_MBps" not in result
    reshard = result["reshard_4_to_2_local"]
    assert reshard["marind_load_s"] > 0 and reshard["dcp_load_s"] > 0 and reshard["marind_read_amplification"] <= 1.1
    assert result["ratios"]["local"]["reshard_load_vs_dcp"] > 0


def test_ckpt_bench_refuses_an_unknown_section():
    out = subprocess.run([sys.executable, "bench/ckpt_bench.py", "--sections", "reshard,bogus"], cwd=REPO_ROOT,
                         env=_as_documented(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--sections 'reshard,bogus': use some of saves, loads, reshard" in out.stderr
    assert out.stdout == ""


def _as_documented() -> dict[str, str]:
    """The bench as README runs it, ``python bench/NAME.py`` from the repo root: no PYTHONPATH
    (only the installed ``marind`` and ``ckpt_store`` are importable, not ``bench``)."""
    env = base_env({"MARIND_LOG_LEVEL": "WARNING"})
    env.pop("PYTHONPATH", None)
    return env

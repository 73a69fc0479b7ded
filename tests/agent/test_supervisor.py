"""torchrun's launcher: PR_SET_PDEATHSIG stops it when the agent dies; leftovers are reaped."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from marind.testing.procs import running, spawn

PARENT = """
import sys, time
from pathlib import Path
from marind.agent.supervisor import TorchrunSupervisor
run_dir = Path(sys.argv[1])
(run_dir / "logs").mkdir(parents=True, exist_ok=True)
sup = TorchrunSupervisor("j", run_dir, [sys.executable, "-c", "import time; time.sleep(120)"], {})
sup.start()
print(sup.pid, flush=True)
time.sleep(120)
"""


def test_child_gets_sigterm_when_the_agent_is_killed(tmp_path):
    parent = spawn([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "sleep" not in " ".join(psutil.Process(child).cmdline()):
        time.sleep(0.05)   # until the shim has exec'd the real command
    assert (tmp_path / "pids.json").exists()
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(child):
        time.sleep(0.05)
    assert not running(child)
    from marind.agent.supervisor import reap_leftovers
    assert reap_leftovers(tmp_path.parent) == []        # nothing left to reap; pids.json removed
    assert not (tmp_path / "pids.json").exists()


def test_leftovers_of_a_previous_agent_are_killed(tmp_path):
    import json

    from marind.agent.supervisor import reap_leftovers
    left = spawn([sys.executable, "-c", "import time; time.sleep(120)"])
    job_dir = tmp_path / "jobs" / "j1"
    job_dir.mkdir(parents=True)
    (job_dir / "pids.json").write_text(json.dumps({"torchrun_pid": left.pid, "processes": [
        {"pid": left.pid, "create_time": psutil.Process(left.pid).create_time()},
        {"pid": 1, "create_time": 0.0}]}))            # a reused pid: never touched
    assert reap_leftovers(tmp_path / "jobs") == [left.pid]
    assert left.wait(10) == -9

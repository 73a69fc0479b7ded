"""Each injector against real processes, real etcd records and real servers.

The fake jobs (tests.chaos.fake_job) are agent -> torchrun -> sleeping
worker trees; their records in etcd follow DESIGN §2. An injector runs as
``python chaos/NAME.py`` and must signal exactly the process its records
name, on this host, in this job, print one JSON line per action and exit
0 when it acted, 1 when it found nothing.
"""

from __future__ import annotations

import signal
import time

import psutil

from tests.chaos.conftest import run_injector


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


# -- kill_random_rank ---------------------------------------------------------------------------
def test_kill_random_rank_kills_one_worker_of_the_job_only(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2)
    other = fake_node("job-b", "n2", 2)
    res = run_injector("kill_random_rank", "--job", "job-a", "--seed", "3",
                       etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0, res.stderr
    assert len(res.lines) == 1
    line = res.lines[0]
    assert set(line) >= {"action", "target", "pid", "rank", "node", "at"}
    assert line["action"] == "kill" and line["node"] == "n1" and line["signal"] == "SIGKILL"
    assert line["pid"] in a.workers and line["rank"] == a.workers.index(line["pid"])
    assert a.wait_exit(line["pid"]) == -signal.SIGKILL
    survivors = [p for p in a.workers if p != line["pid"]] + other.workers
    assert all(a.alive(p) for p in survivors), "only the chosen worker may be signalled"

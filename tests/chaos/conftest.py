"""Helpers for the injector tests: fake jobs as real processes, and running an injector.

``fake_node(job, node, nworkers)`` starts an agent -> torchrun -> workers
tree of real processes (``tests.chaos.fake_job``) and publishes the
docs/design.md §2 records for it in the test's etcd prefix; ``run_injector`` runs
``python chaos/NAME.py`` as a subprocess and parses its JSON lines.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from marind.testing import procs

REPO = procs.REPO_ROOT
_SCENARIO_REPORTS: list = []


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1,
                     help="run each chaos scenario N times and print a table (make chaos)")


def pytest_generate_tests(metafunc):
    repeat = metafunc.config.getoption("repeat", 1)
    scenarios = ("test_scenarios", "test_host_scenarios", "test_host_halfnet_scenarios", "test_host_torchft")
    if repeat > 1 and metafunc.module.__name__.endswith(scenarios):
        metafunc.fixturenames.append("chaos_repetition")
        metafunc.parametrize("chaos_repetition", range(repeat), ids=lambda i: f"rep{i}")


def pytest_runtest_logreport(report):
    if report.nodeid.split("::")[0].endswith(("scenarios.py", "test_host_torchft.py")) and (report.when == "call" or report.outcome == "skipped"
                                                 or (report.when == "setup" and report.failed)):
        _SCENARIO_REPORTS.append(report)


def pytest_terminal_summary(terminalreporter):
    """One row per scenario: runs, passed, failed, xfailed, skipped, mean seconds."""
    if not _SCENARIO_REPORTS:
        return
    rows: dict[str, dict] = {}
    for rep in _SCENARIO_REPORTS:
        name = rep.nodeid.split("::", 1)[-1]
        name = "-".join(p for p in name.replace("[", "-").rstrip("]").split("-")
                        if not p.startswith("rep"))
        row = rows.setdefault(name, {"runs": 0, "passed": 0, "failed": 0, "xfailed": 0,
                                     "skipped": 0, "seconds": 0.0})
        row["runs"] += 1
        if hasattr(rep, "wasxfail"):
            row["xfailed"] += 1
        else:
            row[rep.outcome if rep.outcome in row else "failed"] += 1
        row["seconds"] += rep.duration
    tr = terminalreporter
    width = max(len(n) for n in rows)
    tr.write_sep("=", "chaos scenarios")
    tr.write_line(f"{'scenario':<{width}}  runs  pass  fail  xfail  skip  mean_s")
    for name, r in rows.items():
        ran = r["runs"] - r["skipped"]
        mean = r["seconds"] / ran if ran else 0.0
        tr.write_line(f"{name:<{width}}  {r['runs']:4d}  {r['passed']:4d}  {r['failed']:4d}  "
                      f"{r['xfailed']:5d}  {r['skipped']:4d}  {mean:6.1f}")


@dataclass
class FakeNode:
    job: str
    node: str
    info_path: Path
    proc: subprocess.Popen
    agent_pid: int
    torchrun_pid: int
    workers: list[int]           # pid of global rank base_rank + i
    base_rank: int

    def exits(self) -> dict[int, int]:
        """{pid: returncode} of the workers that ended (negative: killed by that signal)."""
        path = self.info_path.with_name(self.info_path.stem + ".exits.jsonl")
        if not path.exists():
            return {}
        return {r["pid"]: r["returncode"] for r in map(json.loads, path.read_text().splitlines())}

    def wait_exit(self, pid: int, timeout: float = 10.0) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.exits().get(pid)
            if rc is not None:
                return rc
            time.sleep(0.05)
        return None

    def alive(self, pid: int) -> bool:
        return procs.running(pid)


@dataclass
class InjectorResult:
    returncode: int
    lines: list[dict]
    stdout: str
    stderr: str


def run_injector(name: str, *args: str, etcd=None, prefix: str | None = None,
                 timeout: float = 60.0, env: dict | None = None) -> InjectorResult:
    cmd = [sys.executable, str(REPO / "chaos" / f"{name}.py"), *args]
    if etcd is not None:
        cmd += ["--etcd", etcd.endpoint]
    if prefix is not None:
        cmd += ["--prefix", prefix]
    proc = procs.spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.kill_group(proc)
        out, err = proc.communicate(timeout=5)
        raise AssertionError(f"{name} ran past {timeout}s\nstdout:\n{out}\nstderr:\n{err}") from None
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return InjectorResult(proc.returncode, lines, out, err)


@pytest.fixture
def fake_node(tmp_path, etcd_client):
    """Factory: start a fake node of ``job`` with ``nworkers`` workers and publish its records."""

    def make(job: str, node: str, nworkers: int = 2, *, base_rank: int = 0,
             host: str | None = None, publish: bool = True) -> FakeNode:
        info = tmp_path / f"{job}-{node}.json"
        proc = procs.spawn([sys.executable, "-m", "tests.chaos.fake_job", "agent", str(info),
                            str(nworkers)])
        deadline = time.monotonic() + 20
        while not info.exists():
            assert proc.poll() is None, f"fake agent exited with {proc.returncode}"
            assert time.monotonic() < deadline, "fake agent did not start its workers"
            time.sleep(0.05)
        data = json.loads(info.read_text())
        fake = FakeNode(job, node, info, proc, data["agent_pid"], data["torchrun_pid"],
                        data["workers"], base_rank)
        if publish:
            host = host or socket.gethostname()
            etcd_client.put_json(etcd_client.key("nodes", node), {
                "node": node, "host": host, "slots": nworkers, "labels": {}, "version": "test",
                "started_at": data["started_at"]})
            etcd_client.put_json(etcd_client.key("jobs", job, "nodes", node), {
                "state": "RUNNING", "torchrun_pid": fake.torchrun_pid, "agent_pid": fake.agent_pid,
                "host": host, "restarts": 0, "step": 0, "updated_at": time.time(),
                "workers": [{"rank": base_rank + i, "local_rank": i, "pid": pid}
                            for i, pid in enumerate(fake.workers)]})
        return fake

    return make

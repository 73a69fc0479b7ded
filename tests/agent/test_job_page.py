"""The job page in a real browser, against a live agent on the session etcd running a job whose rank is killed.

Headless chromium loads ``/jobs/JOB`` from the agent's metrics port after the job recovered
and finished: the charts have points, the timeline and the events show the restart with its
cause, the ledger's parts add up to the wall time (and `status`, `events --json` and
``marind_job_seconds_total`` carry the same ledger); the page's script refreshed it in place;
a cluster of 100 more jobs renders. Screenshots stay under the test's tmp dir and
``build/test-artifacts/job-page/`` (logged).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from marind.control.lifecycle import JobState, StateRecord
from marind.testing import browser
from tests.agent.helpers import agent_log, job_state, metrics_port, node_registered, start_agent, tiny_spec, wait_for

pytestmark = pytest.mark.skipif(browser.CHROMIUM is None, reason=browser.SKIP_REASON)

ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts" / "job-page"


def _marind(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", *argv], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def _workers(client, job: str, node: str) -> dict[int, int]:
    record = client.get_json(client.key("jobs", job, "nodes", node)) or {}
    return {int(w["rank"]): int(w["pid"]) for w in record.get("workers", [])}


def _step(client, job: str) -> int:
    return int((client.get_json(client.key("jobs", job, "progress")) or {}).get("step") or 0)


def test_the_job_page_of_a_job_with_a_killed_rank(tmp_path, etcd, etcd_client, etcd_prefix):
    env = {"MARIND_ETCD": etcd.endpoint, "MARIND_PREFIX": etcd_prefix}
    agent = start_agent(tmp_path, "p", etcd.endpoint, etcd_prefix, env={"MARIND_TEST_STEP_SLEEP": "0.15"})
    diag = lambda: agent_log(tmp_path, "p")
    wait_for(lambda: node_registered(etcd_client, "p"), 30, "node p registered", diag=diag)
    port = metrics_port(tmp_path, "p")
    base = f"http://127.0.0.1:{port}"

    spec = tiny_spec(tmp_path, name="page", nproc=2, steps=40)
    assert _marind(env, "submit", str(spec), "--id", "page-1").returncode == 0
    wait_for(lambda: _step(etcd_client, "page-1") >= 10, 90, "page-1 at step 10", diag=diag)
    scrape = wait_for(lambda: (t := _get(f"{base}/metrics")) and 'cause="training",job="page-1"' in t and t, 30,
                      "the ledger's counters on /metrics", diag=diag)
    assert "marind_job_seconds_total" in scrape

    rank1 = _workers(etcd_client, "page-1", "p")[1]
    os.kill(rank1, signal.SIGKILL)
    wait_for(lambda: job_state(etcd_client, "page-1").get("state") == "SUCCEEDED", 120, "page-1 SUCCEEDED",
             diag=lambda: f"{job_state(etcd_client, 'page-1')}\n{diag()}")

    dom = browser.dump_dom(f"{base}/jobs/page-1", tmp_path / "profile", budget_ms=3000)
    assert not re.search(r'<body data-updated="0"', dom), "the page's script did not refresh it"
    for label in ("loss", "tokens/s", "step time (s)"):
        points = re.search(rf'data-label="{re.escape(label)}" data-points="(\d+)"', dom)
        assert points and int(points.group(1)) >= 5, (label, dom[-3000:])
    assert 'class="ev ev-restart"' in dom and 'class="mark"' in dom      # on the timeline and on the charts
    restarts = re.findall(r'<span class="kind">restart</span></td><td>([^<]*)</td>', dom)
    assert restarts and any("SIGKILL" in r or "exit" in r for r in restarts), restarts
    seconds = {c: float(s) for c, s in re.findall(r'data-cause="(\w+)" data-seconds="([\d.]+)"', dom)}
    wall = float(re.search(r'class="wall" data-seconds="([\d.]+)"', dom).group(1))
    assert abs(sum(seconds.values()) - wall) < 1.0 and wall > 5, (seconds, wall)
    assert seconds["training"] > 0 and seconds["detection"] > 0 and seconds["restart"] + seconds["rendezvous"] > 0
    assert "wall time (final)" in dom

    # the same ledger in `status JOB` and `events --json`
    status = _marind(env, "status", "page-1")
    assert status.returncode == 0 and re.search(r"page-1: goodput \d+\.\d% of .*lost: ", status.stdout), status.stdout
    lines = [json.loads(line) for line in _marind(env, "events", "page-1", "--json").stdout.splitlines()]
    ledger = lines[-1]["detail"]
    assert lines[-1]["kind"] == "ledger" and ledger["final"]
    assert abs(sum(ledger["seconds"].values()) - ledger["wall_s"]) < 1.0 and abs(ledger["wall_s"] - wall) < 1.0

    shots = [browser.screenshot(f"{base}/jobs/page-1", tmp_path / "job-page.png", tmp_path / "profile")]
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    # 100 jobs more (cancelled at once: the agent leaves them be): the cluster page lists them all
    stored_spec = etcd_client.get(etcd_client.key("jobs", "page-1", "spec"))[0]
    for i in range(100):
        etcd_client.put(etcd_client.key("jobs", f"many-{i:03d}", "spec"), stored_spec)
        etcd_client.put_json(etcd_client.key("jobs", f"many-{i:03d}", "state"),
                             StateRecord(JobState.CANCELLED, reason="test", updated_at=time.time()).to_dict())
    tic = time.monotonic()
    page = _get(f"{base}/")
    served_s = time.monotonic() - tic
    assert page.count('href="/jobs/many-') == 100 and 'href="/jobs/page-1"' in page
    assert served_s < 2.0, f"the cluster page of 101 jobs took {served_s:.2f}s"
    dom = browser.dump_dom(f"{base}/", tmp_path / "profile", budget_ms=2500)
    assert dom.count('href="/jobs/many-') == 100 and "<td>p</td>" in dom
    for shot in shots:
        assert shot.exists() and shot.stat().st_size > 10_000, shot
        shutil.copy(shot, ARTIFACTS / shot.name)
    print(f"job page screenshots: {[str(ARTIFACTS / s.name) for s in shots]} (cluster page of 101 jobs served in "
          f"{served_s:.2f}s)")
    assert agent.poll() is None

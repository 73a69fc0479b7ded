"""The job page in a browser: the cluster page of 100 jobs and one job's page, as headless chromium sees them.

Issue 35 asks that the cluster page of 100 jobs render in under 2 s in the browser. This starts a
private etcd and a real ``marind agent`` (whose metrics port serves the page), writes 100 jobs
through the control plane's own write functions, as the agents and the CLI write them
(``create_job`` and ``start_ledger`` at submission, ``update_state``, ``append_event`` for node
joins, checkpoints, restarts and ends, ``last_error`` records from ``failure_causes.cause_of``,
``report_record`` under the nodes' leases, and ``JobJournal.report`` for the progress, the curves
and the goodput ledger), then loads ``/`` and ``/jobs/JOB`` in headless chromium.

The jobs: a cluster's last 36 hours, mostly finished (55% succeeded, 10% failed, 10% cancelled,
20% running, 5% restarting or pending; some with restarts), on 16 simulated nodes (registered
under their own leases). Every job asks for 8 processes per node and the agent has 1 slot, so
it starts none of them (``job_too_big``) and the page shows them as written. The job page timed
is the heaviest one a job can have: a long run whose curves hold the series' 500 points at most
and whose event ring is full (200 events: checkpoints, restarts).

A repeat loads, each in a fresh ``chromium --headless --dump-dom`` (no virtual time: the DOM
is dumped at the page's load, in real time), the empty page (the page's shell with nothing in
it, from a file: the browser's own start-up), the cluster page and the job page. Per page:

* ``wall_s``: wall-clock time of the browser run (start-up included);
* ``*_page_s`` (the figures): that minus the same repeat's empty page;
* ``in_page_s``: what the page's script noted at its first render (``<body data-rendered-ms>``,
  ``performance.now()`` after laying the page out: from the navigation's start, so the request
  to the agent, the server's work, parsing and layout; paint not included);
* ``served_s``: the agent's answer alone (``urllib``, no browser).

Medians of the repeats; each dumped DOM is checked (every job listed, the charts drawn).
Progress on stderr, one JSON object last on stdout. Exit 2 (one line) without chromium.

    python bench/page_bench.py                   # 100 jobs, 5 repeats
    python bench/page_bench.py --quick           # 10 jobs, 1 repeat: the suite's shape test
    python bench/page_bench.py --jobs 300 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from marind.agent.job_journal import JobJournal
from marind.agent.membership import report_record
from marind.agent.metrics import Metrics
from marind.agent.page import html
from marind.agent.progress import ProgressRecord
from marind.agent.registry import NodeRegistry
from marind.control.events import append_event, list_events
from marind.control.failure_causes import cause_of
from marind.control.job_history import read_series, start_ledger
from marind.control.job_records import create_job, update_state
from marind.control.lifecycle import JobEvent
from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_client import EtcdClient
from marind.core.log import configure_logging
from marind.core.spec import load_spec
from marind.testing import browser
from marind.testing.cluster import start_agent, stop_agent
from marind.testing.procs import exit_on_sigterm

PREFIX = "/page-bench"
SPAN_S = 36 * 3600.0
NPROC = 8                     # per node; the agent has 1 slot: it starts none of the jobs
#: A cluster's jobs by state, 20 at a time (55% succeeded, 10% failed, 10% cancelled, 20% running, ...).
#: Interleaved, so that the first 10 (``--quick``) hold every state.
MIX = ("SUCCEEDED", "FAILED", "RUNNING", "SUCCEEDED", "CANCELLED", "SUCCEEDED", "RESTARTING", "SUCCEEDED", "PENDING",
       "SUCCEEDED", "SUCCEEDED", "RUNNING", "SUCCEEDED", "FAILED", "SUCCEEDED", "CANCELLED", "SUCCEEDED", "RUNNING",
       "SUCCEEDED", "SUCCEEDED")
NAMES = ("llama-8b-sft", "moe-ablation", "tok-sweep", "rm-train", "dpo-mix", "long-ctx", "distill-1b", "vit-pt")
ERRORS = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
          "ValueError: the batch holds no tokens", "RuntimeError: NCCL error: unhandled system error")


def log(msg: str) -> None:
    print(f"[page_bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    """One simulated job: what is written for it, and when."""

    job: str
    name: str                            # the spec's job.name
    state: str
    t0: float                            # submitted
    t_end: float                         # the last report (now for a live job)
    reports: int
    steps: int                           # the spec's target
    final_step: int
    nodes: list[str]
    restarts_at: list[int] = field(default_factory=list)   # report indices
    ckpt_every: int = 5


def plan_jobs(n: int, now: float, n_nodes: int, reports: int, long_reports: int, seed: int = 35) -> list[Plan]:
    """``n`` jobs over the last ``SPAN_S`` (pure); the last running one is the long run of the job page."""
    rng = random.Random(seed)
    states = sorted((MIX[i % len(MIX)] for i in range(n)),
                    key=lambda s: ("SUCCEEDED", "FAILED", "CANCELLED", "RUNNING", "RESTARTING", "PENDING").index(s))
    plans = []
    for i, state in enumerate(states):
        t0 = now - SPAN_S + i * (SPAN_S * 0.95 / n) + rng.uniform(0, 60)
        live = state in ("RUNNING", "RESTARTING")
        t_end = now - rng.uniform(1, 5) if live else min(t0 + rng.uniform(600, 4 * 3600), now - 60)
        steps = rng.choice((2000, 5000, 10000, 20000))
        frac = 1.0 if state == "SUCCEEDED" else rng.uniform(0.1, 0.9)
        nodes = sorted(rng.sample(range(n_nodes), rng.choice((1, 1, 2, 4))))
        restarts = [] if state == "PENDING" else sorted(rng.sample(range(2, reports - 1), min(
            reports - 3, {"FAILED": 3, "RESTARTING": 1}.get(state, rng.choice((0, 0, 0, 1, 2))))))
        if state == "RESTARTING":
            restarts = [reports - 1]
        name = NAMES[i % len(NAMES)]
        plans.append(Plan(job=f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(t0))}-{i:03d}", name=name,
                          state=state, t0=t0, t_end=t_end, reports=0 if state == "PENDING" else reports,
                          steps=steps, final_step=int(steps * frac), nodes=[f"sim-{k:02d}" for k in nodes],
                          restarts_at=restarts))
    running = [p for p in plans if p.state == "RUNNING"]
    if running:                 # the job page's job: a long run, its curves and event ring full
        long = running[-1]
        long.job = long.name = "long-run"
        long.t0, long.reports, long.steps = now - 30 * 3600, long_reports, 200_000
        long.final_step, long.ckpt_every, long.nodes = 150_000, 3, ["sim-00", "sim-01", "sim-02", "sim-03"]
        long.restarts_at = [long_reports * k // 5 for k in range(1, 5)]
    return plans


def spec_dict(name: str, steps: int, nodes: int) -> dict:
    """A run spec as ``marind submit`` stores it (``RunSpec.to_dict()`` of a validated spec)."""
    return load_spec(f"""[job]
name = "{name}"
nodes = "1:{max(nodes, 1)}"
nproc_per_node = {NPROC}
max_restarts = 5
entrypoint = "train"
[data]
path = "/data/corpus"
global_batch = 256
micro_batch = 4
[train]
steps = {steps}
[checkpoint]
url = "s3://ckpt/{name}"
""").to_dict()


def write_job(client: EtcdClient, plan: Plan, leases: dict[str, object], rng: random.Random) -> None:
    """Everything the CLI and the agents would have written for ``plan``, with its times."""
    job, node = plan.job, plan.nodes[0]
    create_job(client, job, spec_dict(plan.name, plan.steps, len(plan.nodes)), now=plan.t0)
    start_ledger(client, job, at=plan.t0)
    if plan.state == "PENDING":
        return
    start = plan.t0 + rng.uniform(5, 120)
    pid = 10_000 + rng.randrange(50_000)
    for n in plan.nodes:
        append_event(client, job, "node_joined", n, {"torchrun_pid": pid, "slots": NPROC}, now=start)
    update_state(client, job, JobEvent.WORKERS_STARTED, reason=f"workers started on {node}")
    journal = JobJournal(job, Metrics())
    step, ckpt, restarts, tps = 0, None, 0, rng.uniform(2e4, 4e5)
    per_report = plan.final_step / max(plan.reports, 1)
    dt = (plan.t_end - start) / max(plan.reports, 1)
    for k in range(plan.reports):
        at = start + (k + 1 + rng.uniform(-0.2, 0.2)) * dt
        if k in plan.restarts_at:
            restarts += 1
            rank = rng.randrange(NPROC * len(plan.nodes))
            cause = cause_of(node=node, exitcode=-9, rank=rank, local_rank=rank % NPROC, pid=pid + rank)
            client.put_json(client.key("jobs", job, "last_error"),
                            {"line": cause.line, "node": node, "at": at, "source": "log", **cause.to_dict()})
            update_state(client, job, JobEvent.RESTART, reason=f"workers restarted on {node}: {cause.line}",
                         restarts=restarts)
            append_event(client, job, "restart", node, {"round": restarts + 1, "restarts": restarts,
                                                        "reason": cause.line, **cause.to_dict()}, now=at)
            if plan.state == "RESTARTING" and k == plan.reports - 1:
                break
            pid, step = pid + 100, ckpt or 0
            update_state(client, job, JobEvent.WORKERS_STARTED, reason=f"workers started on {node}")
        step = max(step, int((k + 1) * per_report))
        if k % plan.ckpt_every == plan.ckpt_every - 1:
            ckpt = step
            append_event(client, job, "checkpoint_committed", node,
                         {"step": step, "duration_s": round(rng.uniform(2, 30), 3)}, now=at)
        done = plan.state == "SUCCEEDED" and k == plan.reports - 1
        loss = 2.0 + 8.0 * math.exp(-5 * step / plan.steps) + rng.gauss(0, 0.05)
        record = ProgressRecord(rank=0, local_rank=0, world_size=NPROC * len(plan.nodes), pid=pid, step=step,
                                loss=round(loss, 4), tokens_per_s=round(tps * rng.uniform(0.9, 1.1), 1),
                                last_checkpoint_step=ckpt, phase="done" if done else "training", updated_at=at)
        journal.report(client, [record], at)
    _end(client, plan, node, step, restarts, pid, leases, rng)


def _end(client: EtcdClient, plan: Plan, node: str, step: int, restarts: int, pid: int,
         leases: dict[str, object], rng: random.Random) -> None:
    job, at = plan.job, plan.t_end + 1
    if plan.state == "SUCCEEDED":
        append_event(client, job, "succeeded", node, {"rc": 0, "step": step, "restarts": restarts}, now=at)
        update_state(client, job, JobEvent.SUCCEEDED, reason="torchrun exited 0", restarts=restarts, step=step)
    elif plan.state == "FAILED":
        cause = cause_of(node=node, exitcode=1, rank=0, local_rank=0, pid=pid, error=rng.choice(ERRORS))
        client.put_json(client.key("jobs", job, "last_error"),
                        {"line": cause.line, "node": node, "at": at, "source": "error_file", **cause.to_dict()})
        append_event(client, job, "failed", node, {"rc": 1, "step": step, "restarts": restarts,
                                                   "reason": cause.line}, now=at)
        update_state(client, job, JobEvent.FAILED, reason=f"torchrun exited 1 after {restarts} restarts",
                     restarts=restarts, step=step)
    elif plan.state == "CANCELLED":
        by = "alice@login-1"
        update_state(client, job, JobEvent.CANCEL, reason=f"cancelled by {by}")
        append_event(client, job, "cancelled", by, {"by": by}, now=at)
    else:                       # live: every node's record, under its lease
        for i, n in enumerate(plan.nodes):
            workers = [] if plan.state == "RESTARTING" else [
                {"rank": i * NPROC + r, "local_rank": r, "pid": pid + r} for r in range(NPROC)]
            record = {"state": "restarting" if plan.state == "RESTARTING" else "running", "torchrun_pid": pid,
                      "workers": workers, "restarts": restarts, "step": step, "updated_at": plan.t_end,
                      "host": f"10.0.0.{i + 10}", "agent_pid": 4242, "node": n, "round": restarts + 1}
            report_record(client, job, n, record, leases[n], None)


def populate(client: EtcdClient, n: int, quick: bool) -> dict:
    """Simulated nodes and ``n`` jobs in etcd; what was written (the job page's job among it)."""
    now = time.time()
    n_nodes = 16 if n >= 50 else 4
    leases: dict[str, object] = {}
    for k in range(n_nodes):
        reg = NodeRegistry(client, f"sim-{k:02d}", slots=NPROC, ttl=3600)
        reg.register()
        leases[reg.node] = reg.lease
    plans = plan_jobs(n, now, n_nodes, reports=6 if quick else 30, long_reports=60 if quick else 740)
    rng = random.Random(36)
    for i, plan in enumerate(plans):
        write_job(client, plan, leases, rng)
        if (i + 1) % 10 == 0 or i + 1 == len(plans):
            log(f"{i + 1}/{len(plans)} jobs written")
    long = next((p.job for p in plans if p.job == "long-run"), plans[-1].job)
    return {"job": long, "series_points": len(read_series(client, long)["points"]),
            "events": len(list_events(client, long)), "nodes": n_nodes,
            "states": {s: sum(p.state == s for p in plans) for s in dict.fromkeys(MIX)}}


def load(url: str, profile: Path, timeout: float) -> tuple[float, float | None, str]:
    """One fresh headless chromium on ``url``: (wall seconds, the page's data-rendered-ms in s, the DOM)."""
    tic = time.monotonic()
    dom = browser.dump_dom(url, profile, budget_ms=None, timeout=timeout)
    wall = time.monotonic() - tic
    found = re.search(r'data-rendered-ms="([\d.]+)"', dom)
    return wall, (float(found.group(1)) / 1000 if found else None), dom


def served(url: str) -> tuple[float, int]:
    tic = time.monotonic()
    body = urllib.request.urlopen(url, timeout=60).read()
    return time.monotonic() - tic, len(body)


def check(name: str, dom: str, jobs: int) -> None:
    """The DOM is the whole page: every job listed (the cluster), the charts drawn (a job)."""
    if "data-rendered-ms" not in dom:
        raise RuntimeError(f"{name}: no data-rendered-ms in the DOM (not rendered?): {dom[-500:]!r}")
    if name == "cluster" and f"<h2>Jobs ({jobs})</h2>" not in dom:
        raise RuntimeError(f"cluster: the page does not list {jobs} jobs: {dom[:1000]!r}")
    if name == "job" and not re.search(r'data-label="loss" data-points="[1-9]', dom):
        raise RuntimeError(f"job: no loss curve drawn: {dom[:1000]!r}")


def measure(base: str, job: str, root: Path, jobs: int, repeats: int, timeout: float) -> dict:
    empty = root / "empty.html"
    empty.write_text(html.shell("marind: the cluster", "/api/cluster", ""))
    urls = {"empty": empty.as_uri(), "cluster": f"{base}/", "job": f"{base}/jobs/{job}"}
    profile = root / "chromium-profile"
    load(urls["empty"], profile, timeout)         # the profile made once, not in a figure
    runs: dict[str, list[tuple[float, float | None]]] = {k: [] for k in urls}
    for r in range(repeats):
        for name, url in urls.items():
            wall, rendered, dom = load(url, profile, timeout)
            check(name, dom, jobs)
            runs[name].append((wall, rendered))
        log(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in runs.items()))
    net = {k: [w - e for (w, _), (e, _) in zip(runs[k], runs["empty"])] for k in ("cluster", "job")}
    serve = {k: [served(urls[k]) for _ in range(repeats)] for k in ("cluster", "job")}
    med = statistics.median
    return {"cluster_page_100_jobs_s": round(med(net["cluster"]), 3), "job_page_s": round(med(net["job"]), 3),
            "empty_page_s": round(med(w for w, _ in runs["empty"]), 3),
            "wall_s": {k: round(med(w for w, _ in v), 3) for k, v in runs.items()},
            "in_page_s": {k: round(med(r or 0.0 for _, r in v), 3) for k, v in runs.items()},
            "served_s": {k: round(med(t for t, _ in v), 4) for k, v in serve.items()},
            "page_bytes": {k: v[0][1] for k, v in serve.items()},
            "runs_wall_s": {k: [round(w, 3) for w, _ in v] for k, v in runs.items()},
            "runs_in_page_s": {k: [round(r or 0.0, 3) for _, r in v] for k, v in runs.items()}}


def wait_port(root: Path, agent, timeout: float = 90) -> int:
    """The agent's metrics port, once it wrote it (its log's tail in the error otherwise)."""
    deadline = time.monotonic() + timeout
    port_file = root / "state-page" / "metrics.port"
    while time.monotonic() < deadline and agent.poll() is None:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        time.sleep(0.2)
    tail = (root / "agent-page.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the agent wrote no metrics port (exit code {agent.poll()}); its log ends:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 jobs, 1 repeat (the suite's shape test)")
    ap.add_argument("--jobs", type=int, help="jobs in the cluster (default 100; --quick 10)")
    ap.add_argument("--repeats", type=int, help="browser loads of each page (default 5; --quick 1)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds one browser run may take")
    args = ap.parse_args(argv)
    configure_logging("WARNING")        # marind's own lines on stderr, stdout keeps the JSON alone
    if browser.CHROMIUM is None:
        print(f"page_bench: {browser.SKIP_REASON}", file=sys.stderr)
        return 2
    jobs = args.jobs or (10 if args.quick else 100)
    repeats = args.repeats or (1 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="page-bench-") as tmp:
        root = Path(tmp)
        etcd = LocalEtcd(root / "etcd").start()
        agent = None
        try:
            agent = start_agent(root, "page", etcd.endpoint, PREFIX, fast=False, slots=1, metrics_port=-1)
            tic = time.monotonic()
            with EtcdClient(etcd.endpoint, prefix=PREFIX) as client:
                written = populate(client, jobs, args.quick)
            populate_s = time.monotonic() - tic
            log(f"{jobs} jobs written in {populate_s:.1f} s; the job page's job {written['job']}: "
                f"{written['series_points']} points, {written['events']} events")
            port = wait_port(root, agent)
            figures = measure(f"http://127.0.0.1:{port}", written["job"], root, jobs, repeats, args.timeout)
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({agent.returncode}) during the bench")
        finally:
            if agent is not None:
                stop_agent(agent)
            etcd.stop()
    print(json.dumps({"bench": "page", "quick": args.quick, "jobs": jobs, "repeats": repeats, **figures,
                      "job_page": {k: written[k] for k in ("job", "series_points", "events")},
                      "nodes": written["nodes"] + 1, "states": written["states"], "populate_s": round(populate_s, 1),
                      "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

"""Goodput under failures; ONE JSON object as the last stdout line.

    python bench/goodput.py [--wall 300] [--every 60] [--seed 7] [--nodes 2] [--nproc 2]
        [--ckpt-every 5] [--fixed] [--quick] [--fault kill|power_off|both] [--back-after 20] [--keep]
        [--memory-ckpt off|on|both]

The example job (the tiny GPT, nodes x nproc gloo ranks under ``marind
agent``s on this machine, async checkpoints to a local directory) runs
for ``--wall`` seconds twice: once with no fault (the baseline) and once
with ``chaos/kill_random_rank.py`` fired at failure times drawn from
``--seed`` (``chaos.schedule.draw_schedule``: exponential gaps with mean
``--every``, or exactly ``--every`` with ``--fixed``).

* goodput: time spent in steps that were kept (the last run of every
  step number, by global rank 0's ``step_s`` less the ``save_s`` a
  checkpoint's snapshot blocked it: the goodput ledger's rule, and what
  torchft's steps, timed from their quorum, already leave out) over the
  wall time from submit; ``goodput_steady`` counts the wall time from the first step
  instead (the start-up, paid once per run, left out).
* lost steps per failure: the highest step reached before the kill minus
  the step the job restored from.
* recovery, per failure, from the kill, split into detection (every
  worker alive at the kill has exited), rendezvous (a full new set of
  workers is spawned), restart (every new worker has imported, joined the
  process group and built its model: its first progress record), restore
  (every new worker has loaded the checkpoint) and first step (rank 0
  finished a step); p50/p95 of each and of the total.

``--fault``: ``kill`` (default) as above, on this machine. ``power_off``
runs the job on the multi-host bed (``marind.testing.hosts``: one host per
node, etcd on the control network, collectives on the data network) and at
each draw silently powers off the host holding global rank 0 (links cut,
processes SIGSTOPped); the recovery watch then waits on the survivors only
(detection: their workers at the fault exited; rendezvous/restart/restore/
first step: the smaller world's). ``--back-after`` seconds after the fault
the host reboots (its processes killed, links back, its agent started
again) and the job grows back. ``both``: the baseline, a ``kill`` run and a
``power_off`` run on one bed; the JSON then has ``faults: {kind: run}``,
``recovery_p50_s`` per kind and the floor ``power_off_recovery_p50_max_s``
(the kill run's p50 + the lease TTL + 2 s). Needs root and ``ip netns``.
``--memory-ckpt on`` runs the elastic jobs with memory checkpoints every step
(``[checkpoint] memory_every = 1`` in /dev/shm, issue 33; durable ones every ``--ckpt-every``
as before); ``both`` runs each elastic run twice, without and with them, plus a fault-free run
with them: ``faults_memory``, ``baseline_memory``, and the ratios
``{kind}_memory_goodput_over_elastic`` and ``memory_step_slowdown`` (mean kept step with
memory checkpoints over without).
With ``--mode torchft`` or ``both`` the bed also runs each fault kind in
torchft mode (``bench/goodput_torchft.py``: one replica group per host; a
power-off takes a group's host away while the others train on):
``faults_torchft: {kind: run}``, and per kind the floors "torchft goodput
above elastic's" and "the surviving groups lose no steps".

``--quick``: 90 s, one failure at 50 s, for a shape test (1 node; 2 with
``--fault power_off``/``both``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from marind.control.config import AgentConfig
from marind.control.local_etcd import LocalEtcd
from marind.testing.bench_sites import FAULTS, BedSite, LoopbackSite
from marind.testing.chaos.schedule import draw_schedule
from marind.testing.cluster import make_data, marind, submit
from marind.testing.hosts import HostBed, bed_unavailable
from marind.testing.procs import exit_on_sigterm

if __package__:     # imported as bench.goodput (the tests)
    from bench.goodput_common import SPEC, Job, job_ledger, kept_step_seconds, ledger_check, percentile
else:               # run as a script: bench/ is sys.path[0] (goodput_torchft imports the same module)
    from goodput_common import SPEC, Job, job_ledger, kept_step_seconds, ledger_check, percentile

PHASES = ("detection", "rendezvous", "restart", "restore", "first_step")
FLOORS = {"goodput_min": 0.85, "recovery_p50_max_s": 15.0}


# -- pure accounting ---------------------------------------------------------------------------------
def phase_split(marks: dict[str, float], t_kill: float) -> dict[str, float] | None:
    """Seconds of each recovery phase from the times each one ended (None if one is missing)."""
    if any(p not in marks for p in PHASES):
        return None
    out, prev = {}, t_kill
    for p in PHASES:
        end = max(marks[p], prev)
        out[p] = round(end - prev, 3)
        prev = end
    out["total"] = round(prev - t_kill, 3)
    return out


# -- watching a live job -------------------------------------------------------------------------------
@dataclass
class Failure:
    at: float
    draw: float
    step_before: int = 0
    restored_step: int | None = None
    marks: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        split = phase_split(self.marks, self.at)
        return {"draw_s": round(self.draw, 2), "step_before": self.step_before,
                "restored_step": self.restored_step,
                "lost_steps": None if self.restored_step is None else self.step_before - self.restored_step,
                "recovery_s": split}


def watch_recovery(job: Job, failure: Failure, old: set[int], old_records: set[int], timeout: float,
                   survivors: tuple[str, ...] | None = None, world: int | None = None) -> None:
    """Fill ``failure.marks`` with the time each recovery phase ended, polling at ~20 Hz.

    ``old``: torchrun's worker children at the fault; ``old_records``: the pids in the progress
    records then (with warm starts the worker is the zygote's child, not torchrun's).
    ``survivors``: the nodes whose old workers must exit (default all; a powered-off host's
    stay stopped); ``world``: the recovered world's ranks (default the job's).
    """
    marks, deadline = failure.marks, time.time() + timeout
    world = world or job.world
    new: set[int] = set()
    while time.time() < deadline and "first_step" not in marks:
        now = time.time()
        alive = job.workers(survivors)
        if "detection" not in marks and not (alive & old):
            marks["detection"] = now
        if "detection" in marks:
            new |= alive - old
            if "rendezvous" not in marks and len(new) >= world:
                marks["rendezvous"] = now
        recs = [r for r in job.records()
                if r.get("pid") not in old_records and float(r.get("updated_at") or 0) >= failure.at]
        if "rendezvous" in marks and len(recs) >= world:
            if "restart" not in marks:
                marks["restart"] = now
            if "restore" not in marks and all(r.get("phase") != "restoring" for r in recs):
                marks["restore"] = now
                failure.restored_step = min(int(r.get("step") or 0) for r in recs)
            rank0 = next((r for r in recs if r.get("rank") == 0), None)
            if "restore" in marks and rank0 and int(rank0.get("step") or 0) > (failure.restored_step or 0):
                marks["first_step"] = now
        time.sleep(0.05)


def current_step(job: Job) -> int:
    return max([int(r.get("step") or 0) for r in job.records()] + [0])


def run_job(root: Path, etcd: LocalEtcd | None, data: str, *, name: str, nodes: int, nproc: int, wall: float,
            every_steps: int, draws: list, fault: str = "kill", site=None, memory_every: int = 0) -> dict:
    """One run of ``wall`` seconds, with a ``fault`` at each draw; goodput and per-failure figures.

    ``site``: where the agents run (``goodput_hosts``); default this machine with ``etcd``.
    ``memory_every``: ``[checkpoint] memory_every`` (memory checkpoints in /dev/shm; 0: off).
    """
    site = site or LoopbackSite(root, etcd.endpoint if etcd else "")
    prefix = f"/goodput-{name}"
    node_names = site.node_names(name, nodes)
    agents = site.start(node_names, prefix)
    failures: list[Failure] = []
    try:
        spec = site.root / f"{name}.toml"
        text = SPEC.format(name=name, nodes=f"1:{nodes}", nproc=nproc, data=data,
                           ckpt=site.root / f"ckpt-{name}", every=every_steps)
        if memory_every:
            text = text.replace("[checkpoint]\n", f"[checkpoint]\nmemory_every = {memory_every}\n"
                                                  f"memory_dir = \"{memory_dir(name)}\"\n")
        spec.write_text(text)
        t0 = time.time()
        job = Job(submit(spec, site.endpoint, prefix, wait=False), site.root, node_names, nodes * nproc, t0)
        end = t0 + wall
        for draw in draws:
            if t0 + draw.at >= end:
                break
            time.sleep(max(0.0, t0 + draw.at - time.time()))
            old = job.workers()
            if len(old) < job.world:   # not (yet) running in full: the draw waits for it
                while time.time() < end and len(job.workers()) < job.world:
                    time.sleep(0.1)
                old = job.workers()
            old_records = {r.get("pid") for r in job.records()}
            per_node = {n: job.workers((n,)) for n in job.nodes}
            failure = Failure(at=time.time(), draw=draw.at, step_before=current_step(job))
            hit = site.inject(fault, job, prefix, draw.seed, agents)
            failure.step_before = max(failure.step_before, current_step(job))
            failures.append(failure)
            old = old & set().union(*(per_node[n] for n in hit.survivors))
            watch_recovery(job, failure, old, old_records, timeout=max(5.0, min(180.0, end - time.time())),
                           survivors=hit.survivors, world=hit.world)
            site.settle(hit, failure.at, prefix, agents)
        time.sleep(max(0.0, end - time.time()))
        marind(["cancel", job.id], site.endpoint, prefix, timeout=60)
        ledger = job_ledger(site.endpoint, prefix, job.id)
        lines = job.step_lines()            # the steps up to the cancel too: the ledger's window ends there
    finally:
        site.stop(agents)
        shutil.rmtree(memory_dir(name), ignore_errors=True)
    first = min((ln.at - ln.step_s for ln in lines), default=end)
    kept_s, kept_n = kept_step_seconds(lines, t0, end)
    runs = sum(1 for ln in lines if t0 <= ln.at <= end)
    return {"wall_s": round(end - t0, 2), "startup_s": round(first - t0, 2),
            "steps_kept": kept_n, "steps_run": runs, "kept_step_s": round(kept_s, 2),
            "goodput": round(kept_s / (end - t0), 4),
            "goodput_steady": round(kept_s / max(1e-9, end - first), 4),
            "failures": [f.to_json() for f in failures],
            "ledger": ledger, "ledger_check": ledger_check(ledger, lines)}


def memory_dir(name: str) -> str:
    """A run's ``[checkpoint] memory_dir`` (host memory; removed after the run)."""
    return f"/dev/shm/marind-goodput-{os.getpid()}-{name}"


def memory_fields(baseline: dict, baseline_mem: dict | None, runs: dict[str, dict],
                  runs_mem: dict[str, dict]) -> dict:
    """``--memory-ckpt both``: each fault kind's run with memory checkpoints every step against the
    one without, and the step slowdown memory checkpoints cost (mean kept step, fault-free runs)."""
    out: dict = {"faults_memory": runs_mem, "ratios": {}}
    for kind, run in runs_mem.items():
        if kind in runs:
            out["ratios"][f"{kind}_memory_goodput_over_elastic"] = round(run["goodput"] / max(1e-9, runs[kind]["goodput"]), 4)
    if baseline_mem is not None and baseline["steps_kept"] and baseline_mem["steps_kept"]:
        step, step_mem = (b["kept_step_s"] / b["steps_kept"] for b in (baseline, baseline_mem))
        out["baseline_memory"] = baseline_mem
        out["ratios"]["memory_step_slowdown"] = round(step_mem / max(1e-9, step), 4)
    return out


def summarize(run: dict) -> dict:
    fs = run["failures"]
    lost = [f["lost_steps"] for f in fs if f["lost_steps"] is not None]
    splits = [f["recovery_s"] for f in fs if f["recovery_s"]]
    rec = {p: {"p50": percentile([s[p] for s in splits], 0.5), "p95": percentile([s[p] for s in splits], 0.95)}
           for p in (*PHASES, "total")}
    dominant = max(PHASES, key=lambda p: rec[p]["p50"] or 0.0) if splits else None
    return {"failures": len(fs), "recovered": len(splits),
            "lost_steps_per_failure": round(statistics.mean(lost), 2) if lost else None,
            "recovery_s": rec, "dominant_phase": dominant}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wall", type=float, default=300.0, help="seconds each run lasts (default 300)")
    parser.add_argument("--every", type=float, default=60.0, help="mean seconds between failures (default 60)")
    parser.add_argument("--fixed", action="store_true", help="a failure exactly every --every seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=2, help="agents (nodes) on this machine (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every N steps (default 5)")
    parser.add_argument("--min-gap", type=float, default=20.0,
                        help="at least this many seconds between failures (default 20)")
    parser.add_argument("--quick", action="store_true", help="1 node, 90 s, one failure at 50 s (shape test)")
    parser.add_argument("--mode", choices=("elastic", "torchft", "both"), default="elastic",
                        help="elastic restart (default), torchft replica groups (bench/goodput_torchft.py), or both")
    parser.add_argument("--fault", choices=(*FAULTS, "both"), default="kill",
                        help="kill a random rank (default, on this machine); power_off the rank-0 host of the "
                             "multi-host bed (needs root and ip netns); both: each in its own run on the bed")
    parser.add_argument("--back-after", type=float, default=20.0,
                        help="power_off: seconds until the host reboots and its agent is back (default 20)")
    parser.add_argument("--memory-ckpt", choices=("off", "on", "both"), default="off",
                        help="elastic runs with memory checkpoints every step ([checkpoint] memory_every = 1, "
                             "issue 33): on, off (default), or both (each elastic run twice, plus a fault-free "
                             "run with them: faults_memory, memory_step_slowdown)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's directory (agents' and workers' logs, checkpoints) for a post-mortem; "
                             "its path goes to stderr (default: removed at the end)")
    args = parser.parse_args()
    if args.quick:
        args.wall, args.every, args.fixed = 90.0, 50.0, True
        args.nodes = 1 if args.fault == "kill" else 2
    if args.fault != "kill" and args.nodes < 2:
        parser.error(f"--fault {args.fault} needs --nodes >= 2 (a survivor)")
    draws = draw_schedule(args.seed, args.every, args.wall, fixed=args.fixed, min_gap=args.min_gap,
                          max_actions=1 if args.quick else None)
    root = Path(tempfile.mkdtemp(prefix="marind-goodput-"))
    try:
        return run_on_bed(args, draws, root) if args.fault != "kill" else run_here(args, draws, root)
    finally:
        if args.keep:
            print(f"goodput: the run's directory is kept: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def run_here(args: argparse.Namespace, draws: list, root: Path) -> int:
    """``--fault kill``: the baseline and the faulted runs on this machine's agents (loopback)."""
    etcd = LocalEtcd(root / "etcd").start()
    try:
        data = make_data(root)
        kw = dict(nodes=args.nodes, nproc=args.nproc, wall=args.wall, every_steps=args.ckpt_every)
        mem = 1 if args.memory_ckpt == "on" else 0
        baseline = run_job(root, etcd, data, name="baseline", draws=[], **kw)
        elastic = run_job(root, etcd, data, name="elastic", draws=draws, memory_every=mem, **kw) \
            if args.mode != "torchft" else None
        both = args.memory_ckpt == "both" and elastic is not None
        baseline_mem = run_job(root, etcd, data, name="baseline-mem", draws=[], memory_every=1, **kw) if both else None
        elastic_mem = run_job(root, etcd, data, name="elastic-mem", draws=draws, memory_every=1, **kw) if both else None
        torchft = None
        if args.mode != "elastic":
            from goodput_torchft import run_torchft, summarize_torchft
            torchft = run_torchft(root, etcd, data, name="torchft", draws=draws, **{**kw, "nodes": max(2, args.nodes)})
            torchft["summary"] = summarize_torchft(torchft)
    finally:
        etcd.stop()
    if elastic is None:
        print(json.dumps({"bench": "goodput", "mode": "torchft", "baseline": baseline, "torchft": torchft,
                          "ratios": {"torchft_goodput_over_baseline":
                                     round(torchft["goodput"] / max(1e-9, baseline["goodput"]), 4)}}))
        return 0
    elastic["summary"] = summarize(elastic)
    p50 = elastic["summary"]["recovery_s"]["total"]["p50"]
    result = {
        "bench": "goodput", "quick": args.quick,
        "config": {"wall_s": args.wall, "every_s": args.every, "fixed": args.fixed, "seed": args.seed,
                   "nodes": args.nodes, "nproc": args.nproc, "ckpt_every_steps": args.ckpt_every,
                   "draws_s": [round(d.at, 2) for d in draws]},
        "baseline": baseline, "elastic": elastic,
        "ratios": {"elastic_goodput_over_baseline": round(elastic["goodput"] / max(1e-9, baseline["goodput"]), 4)},
        "floors": {**FLOORS,
                   "goodput_met": elastic["goodput"] >= FLOORS["goodput_min"],
                   "goodput_steady_met": elastic["goodput_steady"] >= FLOORS["goodput_min"],
                   "recovery_p50_met": p50 is not None and p50 <= FLOORS["recovery_p50_max_s"]},
    }
    result["config"]["memory_ckpt"] = args.memory_ckpt
    if elastic_mem is not None:
        elastic_mem["summary"] = summarize(elastic_mem)
        extra = memory_fields(baseline, baseline_mem, {"kill": elastic}, {"kill": elastic_mem})
        result["ratios"].update(extra.pop("ratios"))
        result.update(extra)
    if torchft is not None:
        result["torchft"] = torchft
        result["ratios"]["torchft_goodput_over_elastic"] = round(torchft["goodput"] / max(1e-9, elastic["goodput"]), 4)
        result["floors"]["torchft_goodput_above_elastic"] = torchft["goodput"] > elastic["goodput"]
        result["floors"]["torchft_survivors_lose_no_steps"] = all(f["lost_steps"] == 0 for f in torchft["failures"])
    print(json.dumps(result))
    return 0


def run_on_bed(args: argparse.Namespace, draws: list, root: Path) -> int:
    """``--fault power_off`` / ``both``: the baseline and each fault kind's run on one multi-host bed."""
    reason = bed_unavailable()
    if reason:
        print(f"Error: --fault {args.fault} needs the multi-host bed: {reason}", file=sys.stderr)
        return 2
    kinds = list(FAULTS) if args.fault == "both" else [args.fault]
    runs: dict[str, dict] = {}
    runs_mem: dict[str, dict] = {}
    baseline_mem = None
    ft_runs: dict[str, dict] = {}
    with HostBed(root / "bed", [f"host{i + 1}" for i in range(args.nodes)]) as bed:
        site = BedSite(bed, args.back_after)
        data = make_data(root)
        kw = dict(nodes=args.nodes, nproc=args.nproc, wall=args.wall, every_steps=args.ckpt_every, site=site)
        baseline = run_job(root, None, data, name="baseline", draws=[], **kw)
        both = args.memory_ckpt == "both" and args.mode != "torchft"
        baseline_mem = run_job(root, None, data, name="baseline-mem", draws=[], memory_every=1, **kw) if both else None
        for kind in kinds:
            if args.mode != "torchft":
                runs[kind] = run_job(root, None, data, name=kind.replace("_", "-"), draws=draws, fault=kind,
                                     memory_every=1 if args.memory_ckpt == "on" else 0, **kw)
                runs[kind]["summary"] = summarize(runs[kind])
            if both:
                runs_mem[kind] = run_job(root, None, data, name=kind.replace("_", "-") + "-mem", draws=draws,
                                         fault=kind, memory_every=1, **kw)
                runs_mem[kind]["summary"] = summarize(runs_mem[kind])
            if args.mode != "elastic":
                from goodput_torchft import run_torchft, summarize_torchft
                ft = run_torchft(root, None, data, name=f"ft-{kind.replace('_', '-')}", draws=draws, fault=kind, **kw)
                ft["summary"] = summarize_torchft(ft)
                ft_runs[kind] = ft
    result = bed_result(args, draws, baseline, runs, ft_runs)
    result["config"]["memory_ckpt"] = args.memory_ckpt
    if runs_mem:
        extra = memory_fields(baseline, baseline_mem, runs, runs_mem)
        result["ratios"].update(extra.pop("ratios"))
        result.update(extra)
    print(json.dumps(result))
    return 0


def bed_result(args: argparse.Namespace, draws: list, baseline: dict, runs: dict[str, dict],
               ft_runs: dict[str, dict] | None = None) -> dict:
    """The JSON of a bed run: each fault kind's run and summary (elastic in ``faults``, torchft in
    ``faults_torchft``), ratios, and the floors."""
    ttl = AgentConfig().lease_ttl
    ft_runs = ft_runs or {}
    p50 = {kind: run["summary"]["recovery_s"]["total"]["p50"] for kind, run in runs.items()}
    floors: dict = {**FLOORS}
    for kind, run in runs.items():
        floors[f"{kind}_goodput_met"] = run["goodput"] >= FLOORS["goodput_min"]
    ratios = {f"{kind}_goodput_over_baseline": round(run["goodput"] / max(1e-9, baseline["goodput"]), 4)
              for kind, run in runs.items()}
    for kind, ft in ft_runs.items():
        ratios[f"torchft_{kind}_goodput_over_baseline"] = round(ft["goodput"] / max(1e-9, baseline["goodput"]), 4)
        floors[f"torchft_{kind}_survivors_lose_no_steps"] = all(f["lost_steps"] == 0 for f in ft["failures"])
        if kind in runs:
            ratios[f"torchft_{kind}_goodput_over_elastic"] = round(ft["goodput"] / max(1e-9, runs[kind]["goodput"]), 4)
            floors[f"torchft_{kind}_goodput_above_elastic"] = ft["goodput"] > runs[kind]["goodput"]
    if "kill" in runs and "power_off" in runs and p50["kill"] is not None:
        limit = round(p50["kill"] + ttl + 2.0, 3)
        floors["power_off_recovery_p50_max_s"] = limit
        floors["power_off_recovery_p50_met"] = p50["power_off"] is not None and p50["power_off"] <= limit
    return {"bench": "goodput", "quick": args.quick, "site": "bed",
            "config": {"wall_s": args.wall, "every_s": args.every, "fixed": args.fixed, "seed": args.seed,
                       "nodes": args.nodes, "nproc": args.nproc, "ckpt_every_steps": args.ckpt_every,
                       "fault": args.fault, "back_after_s": args.back_after, "lease_ttl_s": ttl,
                       "draws_s": [round(d.at, 2) for d in draws]},
            "mode": args.mode, "baseline": baseline, "faults": runs, "faults_torchft": ft_runs,
            "recovery_p50_s": p50, "ratios": ratios, "floors": floors}


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

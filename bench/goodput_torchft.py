"""The torchft mode of the goodput benchmark; ONE JSON object as the last stdout line when run alone.

    python bench/goodput_torchft.py [--wall 300] [--every 60] [--seed 7] [--nodes 2] [--nproc 2] [--quick]

``run_torchft(root, etcd, data, name=..., nodes=..., nproc=..., wall=..., every_steps=..., draws=...)``
runs the goodput benchmark's example job (``SPEC`` of ``bench/goodput_common.py``) under
``[fault] mode = "torchft"`` (each agent one replica group, ``data.global_batch`` split over the
groups so a step is the same work) with a ``chaos/kill_random_rank.py`` kill at each draw, and returns the fields of goodput.py's runs
(``goodput``, ``goodput_steady``, ``steps_kept``, ...) so that ``goodput.py --mode torchft`` can put
it next to the elastic run. With ``site`` a ``BedSite`` and ``fault="power_off"`` the fault is the
silent power-off of a group's host instead (``marind.testing.bench_sites``), which reboots
``back_after`` seconds later while the other groups train on; the victim is back when its group's
new worker has committed a step. The rebooted group starts cold (its torchrun, workers and torch
imports run on the cores the bed's other hosts are training on; ~25 s here), so its return is
watched for up to ``back_after + REBOOT_REJOIN_GRACE_S`` seconds even when that runs past the wall;
goodput still counts the wall only. Per failure:

* ``lost_steps``: the job's step before the kill minus the lowest step any live group committed
  after it (torchft never rolls back: 0 unless something is wrong);
* ``survivor_steps``: steps the other groups committed between the kill and the killed group's
  return, and ``survivor_max_gap_s``, their longest pause between two commits in that window;
* ``rejoin_s``: kill -> the killed group's new worker has committed a step (healed from a peer):
  the first step line in its log after the kill.

Steps are counted once per step number (every group runs every committed step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from goodput_common import SPEC, Job, kept_step_seconds, kill_one, parse_step_lines, percentile

from marind.control.local_etcd import LocalEtcd
from marind.testing.bench_sites import LoopbackSite
from marind.testing.chaos.schedule import draw_schedule
from marind.testing.cluster import make_data, marind, submit
from marind.testing.procs import exit_on_sigterm

REBOOT_REJOIN_GRACE_S = 60.0    # a powered-off host's group: seconds after its reboot that its return is awaited

FAULT = """
[fault]
mode = "torchft"
replica_groups = {groups}
min_replicas = 1
timeout = "15s"
quorum_timeout = "30s"
join_timeout = "500ms"
heartbeat_timeout = "2s"
"""


def torchft_spec(name: str, nodes: int, nproc: int, data: str, ckpt: Path, every: int) -> str:
    text = SPEC.format(name=name, nodes=f"1:{nodes}", nproc=nproc, data=data, ckpt=ckpt, every=every)
    per_group = max(nproc * 2, 16 // nodes)            # global_batch is per group under torchft
    return text.replace("global_batch = 16", f"global_batch = {per_group}") + FAULT.format(groups=nodes)


def _group_records(job: Job) -> dict[str, dict]:
    """Rank 0's progress record of each node's group."""
    out = {}
    for node, run_dir in zip(job.nodes, job.run_dirs()):
        try:
            out[node] = json.loads((run_dir / "progress" / "rank-0.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def _step_times(job: Job, node: str) -> list[tuple[float, int]]:
    run_dir = job.root / f"state-{node}" / "jobs" / job.id
    try:
        lines = parse_step_lines((run_dir / "logs" / "torchrun.log").read_text(errors="replace"))
    except OSError:
        return []
    return sorted((ln.at, ln.step) for ln in lines)


def watch_failure(job: Job, action: dict, t_kill: float, step_before: int, timeout: float) -> dict:
    victim = action.get("node")
    survivors = [n for n in job.nodes if n != victim]
    low, deadline, back_at = step_before, t_kill + timeout, None
    while time.time() < deadline:
        recs = _group_records(job)
        live = [int(recs[n].get("step") or 0) for n in survivors if n in recs]
        low = min([low, *live])
        v = recs.get(victim, {})
        if v.get("pid") != action.get("pid") and int(v.get("step") or 0) > 0 and v.get("phase") == "training":
            # healed (its record says training from the heal on): back at its first committed step,
            # the first step line since the new worker's record was made (phase_s: its time since)
            born = float(v.get("updated_at") or 0.0) - sum((v.get("phase_s") or {}).values())
            committed = [at for at, _ in _step_times(job, victim) if at > max(t_kill, born)]
            if committed:
                back_at = committed[0]
                break
        time.sleep(0.1)
    end = back_at or time.time()
    survivor_steps, gaps = 0, []
    for n in survivors:
        times = [(at, s) for at, s in _step_times(job, n) if t_kill <= at <= end]
        if times:
            survivor_steps = max(survivor_steps, times[-1][1] - times[0][1] + 1)
            edges = [t_kill] + [at for at, _ in times] + [end]
            gaps.append(max(b - a for a, b in zip(edges, edges[1:])))
        else:
            gaps.append(end - t_kill)
    return {"victim": victim, "step_before": step_before, "lost_steps": max(0, step_before - low),
            "survivor_steps": survivor_steps, "survivor_max_gap_s": round(max(gaps, default=0.0), 3),
            "rejoin_s": round(back_at - t_kill, 3) if back_at else None}


def run_torchft(root: Path, etcd: LocalEtcd | None, data: str, *, name: str, nodes: int, nproc: int, wall: float,
                every_steps: int, draws: list, fault: str = "kill", site=None) -> dict:
    """One torchft run of ``wall`` seconds with a ``fault`` at each draw (see the module docstring)."""
    site = site or LoopbackSite(root, etcd.endpoint if etcd else "")
    prefix = f"/goodput-{name}"
    node_names = site.node_names(name, nodes)
    agents = site.start(node_names, prefix)
    failures: list[dict] = []
    try:
        spec = site.root / f"{name}.toml"
        spec.write_text(torchft_spec(name, nodes, nproc, data, site.root / f"ckpt-{name}", every_steps))
        t0 = time.time()
        job = Job(submit(spec, site.endpoint, prefix, wait=False), site.root, node_names, nodes * nproc, t0)
        end = t0 + wall
        for draw in draws:
            if t0 + draw.at >= end:
                break
            time.sleep(max(0.0, t0 + draw.at - time.time()))
            while time.time() < end and len(job.workers()) < job.world:
                time.sleep(0.1)
            records = _group_records(job)
            step_before = max([int(r.get("step") or 0) for r in records.values()] + [0])
            t_kill = time.time()
            reboot = None
            if fault == "kill" and isinstance(site, LoopbackSite):
                victim = kill_one(job, site.endpoint, prefix, draw.seed)["node"]
            else:
                hit = site.inject(fault, job, prefix, draw.seed, agents)
                victim = hit.host or hit.victim
                if hit.host:    # a powered-off host reboots back_after s later while the survivors are watched
                    reboot = threading.Thread(target=site.settle, args=(hit, t_kill, prefix, agents), daemon=True)
                    reboot.start()
            # back: the victim's group has a new rank 0 (a killed rank 1 restarts it too) that trains
            action = {"node": victim, "pid": records.get(victim, {}).get("pid")}
            limit = end - time.time()
            if reboot is not None:  # the rebooted group starts cold on the bed's shared cores: watched past the wall
                limit = max(limit, site.back_after + REBOOT_REJOIN_GRACE_S)
            failures.append(dict(watch_failure(job, action, t_kill, step_before,
                                               timeout=max(5.0, min(180.0, limit))),
                                 draw_s=round(draw.at, 2), fault=fault))
            if reboot is not None:
                reboot.join()
        time.sleep(max(0.0, end - time.time()))
        lines = job.step_lines()
        marind(["cancel", job.id], site.endpoint, prefix, timeout=60)
    finally:
        site.stop(agents)
    first = min((ln.at - ln.step_s for ln in lines), default=end)
    kept_s, kept_n = kept_step_seconds(lines, t0, end)
    return {"wall_s": round(end - t0, 2), "startup_s": round(first - t0, 2), "steps_kept": kept_n,
            "kept_step_s": round(kept_s, 2), "goodput": round(kept_s / (end - t0), 4),
            "goodput_steady": round(kept_s / max(1e-9, end - first), 4), "failures": failures}


def summarize_torchft(run: dict) -> dict:
    fs = run["failures"]
    rejoin = [f["rejoin_s"] for f in fs if f["rejoin_s"] is not None]
    return {"failures": len(fs), "rejoined": len(rejoin),
            "lost_steps_per_failure": round(statistics.mean(f["lost_steps"] for f in fs), 2) if fs else None,
            "survivor_steps_per_failure": round(statistics.mean(f["survivor_steps"] for f in fs), 2) if fs else None,
            "survivor_max_gap_s": {"p50": percentile([f["survivor_max_gap_s"] for f in fs], 0.5),
                                   "p95": percentile([f["survivor_max_gap_s"] for f in fs], 0.95)},
            "rejoin_s": {"p50": percentile(rejoin, 0.5), "p95": percentile(rejoin, 0.95)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wall", type=float, default=300.0)
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--min-gap", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="2 groups of 1 rank, 90 s, one failure at 50 s")
    args = parser.parse_args()
    if args.quick:
        args.wall, args.nproc, args.every, args.fixed = 90.0, 1, 50.0, True
    draws = draw_schedule(args.seed, args.every, args.wall, fixed=args.fixed, min_gap=args.min_gap,
                          max_actions=1 if args.quick else None)
    root = Path(tempfile.mkdtemp(prefix="marind-goodput-torchft-"))
    etcd = LocalEtcd(root / "etcd").start()
    try:
        run = run_torchft(root, etcd, make_data(root), name="torchft", nodes=args.nodes, nproc=args.nproc,
                          wall=args.wall, every_steps=args.ckpt_every, draws=draws)
    finally:
        etcd.stop()
    run["summary"] = summarize_torchft(run)
    print(json.dumps({"bench": "goodput", "mode": "torchft", "quick": args.quick,
                      "config": {"wall_s": args.wall, "every_s": args.every, "seed": args.seed, "nodes": args.nodes,
                                 "nproc": args.nproc, "draws_s": [round(d.at, 2) for d in draws]},
                      "torchft": run,
                      "floors": {"surviving_groups_lose_no_steps": all(f["lost_steps"] == 0 for f in run["failures"])}}))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

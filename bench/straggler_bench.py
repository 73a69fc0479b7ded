"""A straggler taken out of the job (``[fault] straggler_action = "exclude"``); ONE JSON object last.

    python bench/straggler_bench.py [--window 30] [--slow 0.4] [--straggler-window 10] [--quick]

Real: a private etcd, one ``marind agent`` per node on this machine (loopback), the reference
trainer (the tiny GPT, one gloo rank per node, synchronous data parallel), marind's straggler
watch and exclusion. Slowed on purpose: node ``c``'s rank sleeps ``--slow`` seconds inside each
step's compute (``MARIND_TEST_COMPUTE_SLEEP`` in its agent's environment: the chaos hook of
``marind.trainer.compute_time``), about two more healthy steps, so it steps at about a third of
the others' speed and, the training being synchronous, holds the whole job to that.

Three runs of the same job (global batch 12, so 2 and 3 ranks divide it):

* ``healthy``, the baseline: the job on nodes ``a`` and ``b`` alone (``nodes = "2"``);
* ``straggler``: on ``a``, ``b`` and the slowed ``c`` (``nodes = "3"``), stragglers only named;
* ``exclude``: on the same three with ``nodes = "2:3"`` and ``straggler_action = "exclude"``:
  ``c`` is named, taken out, and the job goes on in a new round on ``a`` and ``b``.

Throughput: training steps per second over ``--window`` seconds of global rank 0's step lines
(from ``--skip`` seconds after the world's first step, or after the re-formed world's), medians
not needed: each window counts every step. ``exclude`` also reports when ``c`` was named
(``named_after_s``), taken out (``excluded_after_s``) and the job stepped again on two nodes
(``training_again_after_s``), each from the first step of the three-node world.

Floors (issue 32): named within 60 s; ``ratios.excluded_over_healthy`` >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from marind.control.events import list_events
from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_client import EtcdClient
from marind.testing.cluster import make_data, marind, start_agent, stop_agent, submit
from marind.testing.procs import exit_on_sigterm

if __package__:     # imported as bench.straggler_bench (the tests)
    from bench.goodput_common import StepLine, parse_step_lines
else:
    from goodput_common import StepLine, parse_step_lines

SPEC = """
[job]
name = "{name}"
nodes = "{nodes}"
nproc_per_node = 1
max_restarts = 100
hang_timeout = "120s"
[job.env]
OMP_NUM_THREADS = "1"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 64
global_batch = 12
micro_batch = 2
[train]
steps = 1000000
log_every = 1
[checkpoint]
url = "file://{ckpt}"
every_steps = 50
async = true
[fault]
straggler_factor = 1.5
straggler_window = "{window}s"
straggler_action = "{action}"
"""

FLOORS = {"named_within_s": 60.0, "excluded_over_healthy_min": 0.90}


def steps_per_s(lines: list[StepLine], start: float, window: float) -> float:
    """Steps whose line falls in [start, start + window), per second (each step number once)."""
    return len({ln.step for ln in lines if start <= ln.at < start + window}) / window


def first_step_after(lines: list[StepLine], at: float) -> float | None:
    later = [ln.at for ln in lines if ln.at > at]
    return min(later) if later else None


class Run:
    """One job on its own agents (``a``, ``b``, and the slowed ``c`` when asked) under its own prefix."""

    def __init__(self, root: Path, etcd: str, name: str, nodes: str, action: str, slowed: bool, args):
        self.root, self.etcd, self.name, self.args = root / name, etcd, name, args
        self.root.mkdir(parents=True)
        self.prefix = f"/straggler-{name}"
        self.names = ["a", "b"] + (["c"] if slowed else [])
        self.agents = [start_agent(self.root, n, etcd, self.prefix, slots=1,
                                   extra_env={"MARIND_TEST_COMPUTE_SLEEP": str(args.slow)} if n == "c" else None)
                       for n in self.names]
        spec = self.root / "job.toml"
        spec.write_text(SPEC.format(name=name, nodes=nodes, data=args.data, ckpt=self.root / "ckpt",
                                    window=args.straggler_window, action=action))
        self.client = EtcdClient(etcd, prefix=self.prefix)
        self._wait(lambda: len(self.client.get_prefix_keys(self.client.key("nodes") + "/")) == len(self.names),
                   60, "the agents registered")
        self.job = submit(spec, etcd, self.prefix, wait=False)

    def lines(self) -> list[StepLine]:
        out: list[StepLine] = []
        for n in self.names:
            log = self.root / f"state-{n}" / "jobs" / self.job / "logs" / "torchrun.log"
            if log.exists():
                out += parse_step_lines(log.read_text(errors="replace"))
        return sorted(out, key=lambda ln: ln.at)

    def world(self) -> int:
        return int((self.client.get_json(self.client.key("jobs", self.job, "progress")) or {}).get("world_size") or 0)

    def events(self, kind: str) -> list[dict]:
        return [e for e in list_events(self.client, self.job) if e["kind"] == kind]

    def _wait(self, check, timeout: float, what: str):
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = check()
            if got:
                return got
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: {what} not within {timeout:.0f} s")

    def stepping_with(self, world: int, timeout: float = 300.0) -> float:
        """Wait until the job steps in a world of ``world`` ranks; when it first did (its step line)."""
        self._wait(lambda: self.world() == world and self.lines(), timeout, f"stepping with {world} ranks")
        since = time.time() - 1.0
        self._wait(lambda: first_step_after(self.lines(), since), timeout, "a step")
        return float(first_step_after(self.lines(), since) or since)

    def throughput_from(self, start: float) -> float:
        time.sleep(max(0.0, start + self.args.window - time.time()) + 1.0)
        return round(steps_per_s(self.lines(), start, self.args.window), 3)

    def close(self) -> None:
        try:
            marind(["cancel", self.job], self.etcd, self.prefix, timeout=120)
        except (RuntimeError, OSError):
            pass
        for agent in self.agents:
            stop_agent(agent)
        self.client.close()


def measure(root: Path, etcd: str, args) -> dict:
    out: dict = {}
    run = Run(root, etcd, "healthy", "2", "none", False, args)
    try:
        out["healthy_steps_per_s"] = run.throughput_from(run.stepping_with(2) + args.skip)
    finally:
        run.close()
    run = Run(root, etcd, "straggler", "3", "none", True, args)
    try:
        out["straggler_steps_per_s"] = run.throughput_from(run.stepping_with(3) + args.skip)
    finally:
        run.close()
    run = Run(root, etcd, "exclude", "2:3", "exclude", True, args)
    try:
        t3 = run.stepping_with(3)
        named = run._wait(lambda: run.events("straggler"), 120, "the straggler named")
        excluded = run._wait(lambda: run.events("straggler_excluded"), 120, "the straggler's node taken out")
        again = run.stepping_with(2)
        out.update({"named": named[0]["detail"], "excluded": excluded[0]["detail"],
                    "named_after_s": round(named[0]["at"] - t3, 2),
                    "excluded_after_s": round(excluded[0]["at"] - t3, 2),
                    "training_again_after_s": round(again - t3, 2),
                    "excluded_steps_per_s": run.throughput_from(again + args.skip),
                    "node_left": [e["detail"] for e in run.events("node_left")]})
    finally:
        run.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds of steps counted per run (default 30)")
    parser.add_argument("--skip", type=float, default=5.0, help="seconds after a world's first step before counting")
    parser.add_argument("--slow", type=float, default=0.4, help="node c's extra compute per step, s (default 0.4)")
    parser.add_argument("--straggler-window", type=float, default=10.0,
                        help="fault.straggler_window, s (default 10)")
    parser.add_argument("--quick", action="store_true", help="10 s windows and a 5 s straggler window (shape test)")
    args = parser.parse_args()
    if args.quick:
        args.window, args.skip, args.straggler_window = 10.0, 2.0, 5.0
    root = Path(tempfile.mkdtemp(prefix="marind-straggler-"))
    etcd = LocalEtcd(root / "etcd").start()
    try:
        args.data = make_data(root)
        out = measure(root, etcd.endpoint, args)
    finally:
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)
    healthy = out["healthy_steps_per_s"] or 1e-9
    ratios = {"straggler_over_healthy": round(out["straggler_steps_per_s"] / healthy, 4),
              "excluded_over_healthy": round(out["excluded_steps_per_s"] / healthy, 4)}
    floors = {**FLOORS, "named_met": out["named_after_s"] <= FLOORS["named_within_s"],
              "excluded_over_healthy_met": ratios["excluded_over_healthy"] >= FLOORS["excluded_over_healthy_min"]}
    print(json.dumps({"bench": "straggler", "quick": args.quick,
                      "config": {"window_s": args.window, "skip_s": args.skip, "slow_s": args.slow,
                                 "straggler_window_s": args.straggler_window},
                      "baseline": "healthy: the same job on the two healthy nodes alone",
                      **out, "ratios": ratios, "floors": floors}))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

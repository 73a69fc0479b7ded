"""The agent's cost and recovery time; ONE JSON object as the last stdout line.

* throughput: tokens/s of the same small trainer job under `marind agent`
  (submit, embedded-style local etcd, etcd3 rendezvous) versus plain
  `torchrun --standalone`, tokens over time of the trainer's per-step log
  lines with warm-up steps dropped; ``--rounds`` pairs run alternately, and the
  ratio marind/torchrun is the median of the per-round ratios (floor: >= 0.97).
* node_death: two agents run one job (nodes = "1:2", 1 proc each); one
  agent's whole process tree is SIGKILLed; the time to the re-formed
  job's first step is split, as seen on the survivor, into detection
  (kill -> its old workers gone), rendezvous (-> new workers spawned),
  restart (-> a worker reports phase "restoring") and restore (-> the
  first step after the kill).
* rendezvous: time for 8/32/64 simulated agents on etcd3 versus c10d,
  from ``measure()`` of bench/rendezvous_bench.py (the rendezvous
  engineer's) when that file exists.

``--quick``: throughput only, few steps, so a test can check the shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_client import EtcdClient
from marind.testing.cluster import env as _env
from marind.testing.cluster import kill_tree as _kill_tree
from marind.testing.cluster import make_data as _make_data
from marind.testing.cluster import start_agent as _agent
from marind.testing.cluster import stop_agent
from marind.testing.cluster import submit as _submit
from marind.testing.procs import exit_on_sigterm

REPO = Path(__file__).resolve().parents[1]

SPEC = """
[job]
name = "bench"
nodes = "{nodes}"
nproc_per_node = {nproc}
max_restarts = 5
hang_timeout = "300s"
[model]
preset = "{preset}"
[data]
path = "{data}"
seq_len = 64
global_batch = 8
micro_batch = 2
[train]
steps = {steps}
[checkpoint]
url = "file://{ckpt}"
every_steps = {every}
"""


#: big enough that a step is compute, not 2 processes' scheduling jitter on 2 cores
THROUGHPUT_PRESET = "small"


def _rate(step_tps: list[float]) -> float:
    """Tokens/s over the measured steps: total tokens / total time (the harmonic mean)."""
    return len(step_tps) / sum(1.0 / v for v in step_tps)


def _step_tps(text: str, warmup: int) -> list[float]:
    out = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0 or '"tokens_per_s"' not in line:
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            continue
        if rec.get("event") == "step" and int(rec.get("step", 0)) > warmup:
            out.append(float(rec["tokens_per_s"]))
    return out


def _spec(root: Path, name: str, data: str, *, nodes="1", nproc=2, steps=20, every=0,
          preset="tiny") -> Path:
    path = root / f"{name}.toml"
    path.write_text(SPEC.format(nodes=nodes, nproc=nproc, data=data, steps=steps, preset=preset,
                                ckpt=root / f"ckpt-{name}", every=every))
    return path


def _plain_run(root: Path, data: str, steps: int, warmup: int, tag: str) -> list[float]:
    spec = _spec(root, f"plain-{tag}", data, steps=steps, preset=THROUGHPUT_PRESET)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "marind.trainer", str(spec)], env=_env(), capture_output=True, text=True,
                         timeout=900, cwd=REPO)
    return _step_tps(res.stdout + res.stderr, warmup)


def _marind_run(root: Path, etcd: LocalEtcd, prefix: str, data: str, steps: int, warmup: int,
                tag: str) -> list[float]:
    job = _submit(_spec(root, f"marind-{tag}", data, steps=steps, preset=THROUGHPUT_PRESET),
                  etcd.endpoint, prefix, wait=True)
    log = (root / "state-tp" / "jobs" / job / "logs" / "torchrun.log").read_text(errors="replace")
    return _step_tps(log, warmup)


def bench_throughput(root: Path, etcd: LocalEtcd, data: str, steps: int, warmup: int,
                     rounds: int) -> dict:
    """``rounds`` plain/marind pairs, alternating which goes first; one agent throughout.

    A single pair is mostly noise on a small shared machine (plain torchrun
    alone varied widely across runs: docs/perf.md, "Daemon and warm starts"),
    so the ratio reported is the median of the per-round ratios, next to the
    ratio over all steps pooled. A run's rate is its tokens over its time (``_rate``).
    """
    prefix = "/bench-tp"
    agent = _agent(root, "tp", etcd.endpoint, prefix, fast=False)   # the defaults a user gets
    plain_all, under_all, per_round = [], [], []
    try:
        for i in range(rounds):
            order = ("plain", "marind") if i % 2 == 0 else ("marind", "plain")
            got = {}
            for kind in order:
                got[kind] = (_plain_run(root, data, steps, warmup, str(i)) if kind == "plain"
                             else _marind_run(root, etcd, prefix, data, steps, warmup, str(i)))
                if not got[kind]:
                    raise RuntimeError(f"no per-step tokens/s found in the {kind} run's logs")
            p, m = _rate(got["plain"]), _rate(got["marind"])
            per_round.append({"torchrun": round(p, 1), "marind": round(m, 1), "ratio": round(m / p, 4)})
            plain_all += got["plain"]
            under_all += got["marind"]
    finally:
        stop_agent(agent)
    p, m = _rate(plain_all), _rate(under_all)
    return {"torchrun_tokens_per_s": round(p, 1), "marind_tokens_per_s": round(m, 1),
            "ratio": round(statistics.median(r["ratio"] for r in per_round), 4),
            "ratio_pooled": round(m / p, 4), "floor": 0.97, "rounds": per_round,
            "model_preset": THROUGHPUT_PRESET, "steps_measured_per_run": steps - warmup}


def bench_node_death(root: Path, etcd: LocalEtcd, data: str) -> dict:
    prefix = "/bench-nd"
    client = EtcdClient(etcd.endpoint, prefix=prefix)
    a, b = _agent(root, "a", etcd.endpoint, prefix), _agent(root, "b", etcd.endpoint, prefix)
    try:
        job = _submit(_spec(root, "elastic", data, nodes="1:2", nproc=1, steps=400, every=5),
                      etcd.endpoint, prefix, wait=False)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            doc = client.get_json(client.key("jobs", job, "progress")) or {}
            if doc.get("world_size") == 2 and doc.get("step", 0) >= 12:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the job never ran on two nodes")
        rec = client.get_json(client.key("jobs", job, "nodes", "a"))
        old = {w["pid"] for w in rec["workers"]}
        progress_dir = root / "state-a" / "jobs" / job / "progress"
        try:
            stubs_at_kill = {c.pid for c in psutil.Process(rec["torchrun_pid"]).children()}
        except psutil.Error:
            stubs_at_kill = set()
        t0 = time.time()
        _kill_tree(b)
        marks: dict[str, float] = {}
        step_at_kill = None
        while time.time() - t0 < 300 and "first_step" not in marks:
            if "old_gone" not in marks and not any(psutil.pid_exists(p) for p in old):
                marks["old_gone"] = time.time()
            try:   # torchrun's worker children (a worker or its zygote stub: it has a RANK), not the zygote
                kids = {c.pid for c in psutil.Process(rec["torchrun_pid"]).children() if "RANK" in c.environ()}
            except psutil.Error:
                kids = set()
            if "old_gone" in marks and "spawned" not in marks and kids - old - stubs_at_kill:
                marks["spawned"] = time.time()
            for path in progress_dir.glob("rank-*.json"):
                try:
                    r = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if r["pid"] in old:
                    step_at_kill = r["step"]
                elif "spawned" in marks:
                    if "restoring" not in marks and r["phase"] in ("restoring", "training"):
                        marks["restoring"] = time.time()
                    if "restoring" in marks and r["phase"] == "training" and r["step"] > (r.get("last_checkpoint_step") or 0):
                        marks["first_step"] = time.time()
            time.sleep(0.02)
        if "first_step" not in marks:
            raise RuntimeError(f"the re-formed job never stepped (marks {sorted(marks)})")
        return {"detection_s": round(marks["old_gone"] - t0, 2),
                "rendezvous_s": round(marks["spawned"] - marks["old_gone"], 2),
                "restart_s": round(marks["restoring"] - marks["spawned"], 2),
                "restore_s": round(marks["first_step"] - marks["restoring"], 2),
                "total_s": round(marks["first_step"] - t0, 2), "step_at_kill": step_at_kill}
    finally:
        for proc in (a, b):
            stop_agent(proc)
        client.close()


def bench_rendezvous(endpoint: str) -> dict:
    try:
        from rendezvous_bench import measure  # the rendezvous engineer's
    except ImportError as exc:
        return {"skipped": f"bench/rendezvous_bench.py not available ({exc})"}
    try:
        return measure((8, 32, 64), repeats=3, etcd_endpoint=endpoint)
    except Exception as exc:  # noqa: BLE001 - report, don't hide the rest
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="throughput only, few steps (shape test)")
    parser.add_argument("--rounds", type=int, default=5, help="plain/marind throughput pairs (default 5)")
    parser.add_argument("--only", choices=("throughput", "node_death", "rendezvous"),
                        help="run one part only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="marind-daemon-bench-"))
    etcd = LocalEtcd(root / "etcd").start()
    try:
        data = _make_data(root)
        result = {"bench": "daemon", "quick": args.quick}
        skipped = {"skipped": "--quick" if args.quick else f"--only {args.only}"}
        wanted = (lambda part: not args.quick and args.only in (None, part))
        if args.quick or args.only in (None, "throughput"):
            result["throughput"] = bench_throughput(root, etcd, data, steps=8 if args.quick else 60,
                                                    warmup=2 if args.quick else 10,
                                                    rounds=1 if args.quick else args.rounds)
        else:
            result["throughput"] = skipped
        result["node_death"] = bench_node_death(root, etcd, data) if wanted("node_death") else skipped
        result["rendezvous"] = bench_rendezvous(etcd.endpoint) if wanted("rendezvous") else skipped
        result["ratios"] = {"marind_over_torchrun_tokens_per_s": result["throughput"].get("ratio")}
    finally:
        etcd.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

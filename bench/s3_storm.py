"""Training steps during an S3 storm, against the same job without one (issue 32's floor: >= 90 %).

    python bench/s3_storm.py [--storm 30] [--status 503] [--every 5] [--out FILE]

Starts the test S3 (SeaweedFS) with a fault proxy in front of it (``marind.testing.s3_faults``),
then runs the reference trainer twice, 2 ranks under torchrun on this machine, checkpointing to
S3 through the proxy every ``--every`` steps, as under an agent (``MARIND_RUN_DIR`` set: saves
never hold a step longer than ``checkpoint.prepare_timeout``):

* ``baseline``: no faults; the steps made in the ``--storm`` seconds that start 2 s after its
  first commit;
* ``storm``: the same, with every request answered ``--status`` (503 SlowDown) for those seconds.

Each run is then stopped (SIGTERM: a clean stop that saves the step reached). Prints one JSON
object: the steps in the window of each run, their ratio and the floor, the storm's answered
requests, and the checkpoints: every step a run logged committed is still committed and
verifies (``lost`` counts those that are not). The figure goes to docs/perf.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from ckpt_store import CheckpointStore
from marind.testing.procs import exit_on_sigterm, kill_group, spawn
from marind.testing.s3_faults import S3FaultProxy
from marind.testing.s3_server import ACCESS_KEY, SECRET_KEY, SeaweedS3
from marind.trainer.data import corpus

SPEC = """
[job]
name = "{name}"
nproc_per_node = 2
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = 1000000
log_every = 1
[checkpoint]
url = "{url}"
every_steps = {every}
keep_last = 0
"""
#: the window starts this long after the run's first commit
LEAD_S = 2.0
FLOOR = 0.9


def _records(log: Path, event: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"event": "{event}"' in line and "{" in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return out


def _at(rec: dict) -> float:
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


def run(name: str, work: Path, s3: SeaweedS3, proxy: S3FaultProxy, data: str, every: int, storm_s: float,
        status: int) -> dict:
    """One run: start, wait for its first commit, storm (or not) for ``storm_s``, stop; its figures."""
    url = s3.url(f"bench-{name}-{time.time_ns()}")
    spec = work / f"{name}.toml"
    spec.write_text(SPEC.format(name=name, data=data, url=url, every=every))
    log = work / f"{name}.log"
    env = {"MARIND_RUN_DIR": work / f"run-{name}", "MARIND_JOB_ID": f"bench-{name}",
           "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}
    with open(log, "wb") as fh:
        proc = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      "-m", "marind.trainer", str(spec)], env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not any(r.get("rank") == 0 for r in _records(log, "ckpt_committed")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no first commit ({proc.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(LEAD_S)
        start = time.time()
        if storm_s and status:
            proxy.storm(storm_s, status=status)
        time.sleep(storm_s)
        end = time.time()
        proxy.clear()
        time.sleep(3.0)
        kill_group(proc, signal.SIGTERM)
        proc.wait(300)
    finally:
        kill_group(proc)
        proc.wait(30)
    steps = [r for r in _records(log, "step") if r.get("rank") == 0]
    in_window = sorted({int(r["step"]) for r in steps if start <= _at(r) < end})
    committed = sorted({int(r["step"]) for r in _records(log, "ckpt_committed") if r.get("rank") == 0})
    store = CheckpointStore(url, storage_options=s3.storage_options)
    present = set(store.steps())
    bad = [s for s in sorted(present) if not store.verify(s).ok]
    store.close()
    return {"steps_in_window": len(in_window), "committed": committed,
            "failed_saves": len({r["step"] for r in _records(log, "checkpoint_failed") if r.get("rank") == 0}),
            "skipped_saves": len({r["step"] for r in _records(log, "checkpoint_skipped") if r.get("rank") == 0}),
            "lost": len(set(committed) - present), "unverified": bad}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storm", type=float, default=30.0, help="seconds of the storm (and of the window)")
    ap.add_argument("--status", type=int, default=503, help="the status every request gets during it")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="marind-s3-storm-") as tmp:
        work = Path(tmp)
        data = str(work / "corpus")
        corpus.write_example_dataset(data, 60)
        s3 = SeaweedS3(work / "s3")
        s3.start()
        try:
            with S3FaultProxy(s3.endpoint, seed=1) as proxy:
                base = run("baseline", work, s3, proxy, data, args.every, args.storm, 0)
                storm = run("storm", work, s3, proxy, data, args.every, args.storm, args.status)
                answered = proxy.counts["status"]
        finally:
            s3.stop()
    ratio = storm["steps_in_window"] / base["steps_in_window"] if base["steps_in_window"] else None
    out = {"bench": "s3_storm", "storm_s": args.storm, "status": args.status, "every_steps": args.every,
           "baseline": base, "storm": storm, "storm_answered": answered,
           "steps_ratio": round(ratio, 3) if ratio is not None else None, "floor": FLOOR,
           "floor_met": ratio is not None and ratio >= FLOOR and storm["lost"] == 0 and not storm["unverified"]}
    text = json.dumps(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

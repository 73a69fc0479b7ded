"""What ``bench/goodput.py`` (elastic) and ``bench/goodput_torchft.py`` (torchft) share: the example
job's spec, the ``Job`` being watched, global rank 0's step records and the kept-step accounting.

Both scripts import this module and neither imports the other at load time (``goodput.py`` imports
``goodput_torchft`` for ``--mode torchft``), so a run loads each once and has one ``Job`` class.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from marind.testing.bench_sites import kill_cmd, kill_line
from marind.testing.cluster import env

REPO = Path(__file__).resolve().parents[1]

SPEC = """
[job]
name = "{name}"
nodes = "{nodes}"
nproc_per_node = {nproc}
max_restarts = 1000
hang_timeout = "120s"
entrypoint = "marind.trainer"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 128
global_batch = 16
micro_batch = 2
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 20
[train]
steps = 1000000
seed = 1234
log_every = 1
[checkpoint]
url = "file://{ckpt}"
every_steps = {every}
async = true
keep_last = 2
"""


# -- pure accounting ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepLine:
    at: float          # unix time the step ended
    step: int
    step_s: float      # end to end, since the step before ended
    save_s: float = 0.0    # of step_s, the time a save before the step blocked training

    @property
    def training_s(self) -> float:
        """The step's time less the save that blocked it (a checkpoint is not training)."""
        return self.step_s - self.save_s


def parse_step_lines(text: str) -> list[StepLine]:
    """Global rank 0's ``step`` records in a trainer log."""
    out = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0 or '"event": "step"' not in line:
            continue
        try:
            rec = json.loads(line[start:])
            at = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append(StepLine(at, int(rec["step"]), float(rec["step_s"]), float(rec.get("save_s") or 0.0)))
        except (ValueError, KeyError):
            continue
    return out


def kept_steps(lines: list[StepLine], start: float, end: float) -> list[StepLine]:
    """The steps kept: of each step number, its last run within [start, end]."""
    return _one_run_per_step(lines, start, end, last=True)


def first_runs(lines: list[StepLine], start: float, end: float) -> list[StepLine]:
    """Each step number's first run within [start, end]: the step the job advanced by (a run
    after a rollback redoes a step; the goodput ledger charges that to ``recompute``)."""
    return _one_run_per_step(lines, start, end, last=False)


def _one_run_per_step(lines: list[StepLine], start: float, end: float, *, last: bool) -> list[StepLine]:
    runs: dict[int, StepLine] = {}
    for ln in sorted(lines, key=lambda x: x.at):
        if start <= ln.at <= end and (last or ln.step not in runs):
            runs[ln.step] = ln
    return list(runs.values())


def kept_step_seconds(lines: list[StepLine], start: float, end: float) -> tuple[float, int]:
    """(seconds, count) of the steps kept (``kept_steps``): each one's ``step_s`` less the save that
    blocked it (a checkpoint is not training: the goodput ledger's rule, ``ledger_check``)."""
    kept = kept_steps(lines, start, end)
    return sum(ln.training_s for ln in kept), len(kept)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 3)


# -- watching a live job -------------------------------------------------------------------------------
@dataclass
class Job:
    id: str
    root: Path
    nodes: list[str]
    world: int
    submitted_at: float

    def run_dirs(self, nodes: tuple[str, ...] | list[str] | None = None) -> list[Path]:
        return [self.root / f"state-{n}" / "jobs" / self.id for n in (self.nodes if nodes is None else nodes)]

    def records(self) -> list[dict]:
        out = []
        for run_dir in self.run_dirs():
            for path in (run_dir / "progress").glob("rank-*.json"):
                try:
                    out.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    continue
        return out

    def workers(self, nodes: tuple[str, ...] | None = None) -> set[int]:
        """Live workers as torchrun sees them (of ``nodes``, default all): its children with a RANK
        (a worker, or its zygote stub; a stopped one counts)."""
        pids = set()
        for run_dir in self.run_dirs(nodes):
            try:
                torchrun = json.loads((run_dir / "pids.json").read_text())["torchrun_pid"]
                children = psutil.Process(torchrun).children()
            except (OSError, ValueError, KeyError, psutil.Error):
                continue
            for c in children:
                try:
                    if c.status() != psutil.STATUS_ZOMBIE and "RANK" in c.environ():
                        pids.add(c.pid)
                except psutil.Error:
                    continue
        return pids

    def step_lines(self) -> list[StepLine]:
        out = []
        for run_dir in self.run_dirs():
            try:
                out += parse_step_lines((run_dir / "logs" / "torchrun.log").read_text(errors="replace"))
            except OSError:
                continue
        return out


def kill_one(job: Job, etcd: str, prefix: str, seed: int) -> dict:
    res = subprocess.run(kill_cmd(job.id, etcd, prefix, seed), env=env(), capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    return kill_line(res)


def job_ledger(endpoint: str, prefix: str, job: str) -> dict:
    """The job's goodput ledger as marind keeps it (``marind events JOB --json``'s last line), beside
    the bench's own outside measurement; ``{"error": ...}`` when it cannot be read."""
    from marind.control.job_history import read_ledger
    from marind.core.errors import MarindError
    from marind.core.etcd_client import EtcdClient

    try:
        with EtcdClient(endpoint, prefix=prefix) as client:
            return read_ledger(client, job)
    except (MarindError, OSError, ValueError) as exc:   # reported, rather than losing the run
        return {"error": f"{type(exc).__name__}: {exc}"}


def ledger_check(ledger: dict, lines: list[StepLine]) -> dict:
    """The ledger beside the bench's own figure over the ledger's window (the submission to the job's end),
    by the ledger's rule (``training``: the steps that took the job past the highest step it had
    reached, ``marind.control.goodput_ledger``): ``outside_goodput`` is each step number's first
    run's time less the save that blocked it (``step_s - save_s`` of global rank 0's step lines, as
    the trainer timed them) over the ledger's wall time. Also the parts' sum against the wall time."""
    if "seconds" not in ledger or ledger.get("goodput") is None or not ledger.get("wall_s"):
        return {"readable": False}
    advanced = first_runs(lines, float(ledger["start"]), float(ledger["end"]))
    outside = sum(ln.training_s for ln in advanced) / ledger["wall_s"]
    parts = sum(ledger["seconds"].values())
    return {"readable": True, "parts_minus_wall_s": round(parts - ledger["wall_s"], 3),
            "outside_goodput": round(outside, 4), "goodput_minus_outside": round(ledger["goodput"] - outside, 4)}

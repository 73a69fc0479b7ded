"""Workers' progress records: ``$MARIND_RUN_DIR/progress/rank-{rank}.json``.

Each worker writes its record atomically after every step::

    {"rank", "local_rank", "world_size", "pid", "step", "loss", "tokens_per_s",
     "last_checkpoint_step", "phase", "updated_at"}

The agent reads them here, keeps only the records of live workers of the
current generation (``pids``), and summarises them for etcd. Everything
below except ``read_records`` is pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PHASES = ("starting", "restoring", "training", "checkpointing", "done")


@dataclass(frozen=True)
class ProgressRecord:
    rank: int
    local_rank: int
    world_size: int
    pid: int
    step: int
    loss: float | None
    tokens_per_s: float | None
    last_checkpoint_step: int | None
    phase: str
    updated_at: float

    @classmethod
    def from_dict(cls, d: dict) -> ProgressRecord:
        def opt_float(v):
            return None if v is None else float(v)
        return cls(rank=int(d["rank"]), local_rank=int(d.get("local_rank", 0)),
                   world_size=int(d.get("world_size", 0)), pid=int(d.get("pid", 0)),
                   step=int(d.get("step", 0)), loss=opt_float(d.get("loss")),
                   tokens_per_s=opt_float(d.get("tokens_per_s")),
                   last_checkpoint_step=(None if d.get("last_checkpoint_step") is None
                                         else int(d["last_checkpoint_step"])),
                   phase=str(d.get("phase", "training")), updated_at=float(d.get("updated_at", 0.0)))


def progress_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "progress"


def read_records(run_dir: str | Path) -> list[ProgressRecord]:
    """Every readable record (a half-written or foreign file is skipped)."""
    out = []
    directory = progress_dir(run_dir)
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("rank-*.json")):
        try:
            out.append(ProgressRecord.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def current(records: list[ProgressRecord], pids: set[int]) -> list[ProgressRecord]:
    """Records written by the live workers ``pids`` (stale generations dropped)."""
    return sorted((r for r in records if r.pid in pids), key=lambda r: r.rank)


def node_step(records: list[ProgressRecord]) -> int:
    return max((r.step for r in records), default=0)


def stall_marker(records: list[ProgressRecord]) -> tuple | None:
    """What must change for the node to count as progressing; None before any record."""
    if not records:
        return None
    return (min(r.step for r in records), tuple(sorted({r.phase for r in records})))


def all_done(records: list[ProgressRecord]) -> bool:
    return bool(records) and all(r.phase == "done" for r in records)


def job_summary(records: list[ProgressRecord]) -> dict | None:
    """``{p}/jobs/{job}/progress`` from the record of global rank 0, if this node has it."""
    for r in records:
        if r.rank == 0:
            return {"step": r.step, "loss": r.loss, "tokens_per_s": _total_tps(records, r),
                    "last_checkpoint_step": r.last_checkpoint_step, "world_size": r.world_size,
                    "phase": r.phase, "updated_at": r.updated_at}
    return None


def _total_tps(records: list[ProgressRecord], rank0: ProgressRecord) -> float | None:
    # the trainer reports the job-wide figure on every rank; keep rank 0's
    return rank0.tokens_per_s

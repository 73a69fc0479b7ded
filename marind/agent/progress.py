"""What the agent makes of its workers' progress records.

The record, its file (``$MARIND_RUN_DIR/progress/rank-{rank}.json``) and its tolerant
reader are defined once in ``marind.core.progress`` (re-exported here). The agent reads
them, keeps only the records of live workers of the current generation (``pids``), and
summarises them for etcd. Everything defined below is pure.
"""

from __future__ import annotations

from typing import Any

from marind.core.progress import PHASES, ProgressRecord, progress_dir, read_records

__all__ = ["PHASES", "ProgressRecord", "all_done", "current", "drift_findings", "job_summary", "node_step",
           "progress_dir", "read_records", "stall_marker"]


def current(records: list[ProgressRecord], pids: set[int]) -> list[ProgressRecord]:
    """Records written by the live workers ``pids`` (stale generations dropped)."""
    return sorted((r for r in records if r.pid in pids), key=lambda r: r.rank)


def node_step(records: list[ProgressRecord]) -> int:
    """The furthest step any of ``records`` reached (0 without records)."""
    return max((r.step for r in records), default=0)


def stall_marker(records: list[ProgressRecord]) -> tuple[int, tuple[str, ...]] | None:
    """What must change for the node to count as progressing; None before any record."""
    if not records:
        return None
    return (min(r.step for r in records), tuple(sorted({r.phase for r in records})))


def all_done(records: list[ProgressRecord]) -> bool:
    """True when there are records and every one is in phase ``done``."""
    return bool(records) and all(r.phase == "done" for r in records)


def job_summary(records: list[ProgressRecord]) -> dict[str, Any] | None:
    """``{p}/jobs/{job}/progress`` from the record of global rank 0, if this node has it."""
    for r in records:
        if r.rank == 0:
            return {"step": r.step, "loss": r.loss, "tokens_per_s": _total_tps(records, r),
                    "last_checkpoint_step": r.last_checkpoint_step, "world_size": r.world_size,
                    "phase": r.phase, "updated_at": r.updated_at,
                    **({"checkpoint_error": r.checkpoint_error} if r.checkpoint_error else {})}
    return None


def _total_tps(records: list[ProgressRecord], rank0: ProgressRecord) -> float | None:
    # the trainer reports the job-wide figure on every rank; keep rank 0's
    return rank0.tokens_per_s


def drift_findings(records: list[ProgressRecord], seen: dict[tuple[int, int], bool]) -> list[dict[str, Any]]:
    """The ``replica_drift`` events the records call for (torchft: ``marind.trainer.ft.drift``).

    A group's finding is reported once when it appears (``healed`` false: it heals at its next
    quorum) and once more when its record says it healed. Every rank of a group carries the same
    finding; the lowest rank's counts.

    Args:
        records: the current round's records.
        seen: (replica group, step) -> healed, as reported so far; updated in place.

    Returns:
        The events' details (``{replica_group, step, reason, healed}``), oldest first.
    """
    out = []
    for r in sorted(records, key=lambda rec: rec.rank):
        d = r.drift
        if r.replica_group is None or not d or not isinstance(d.get("step"), int):
            continue
        key, healed = (r.replica_group, d["step"]), bool(d.get("healed"))
        if key in seen and (seen[key] or not healed):
            continue
        seen[key] = healed
        out.append({"replica_group": r.replica_group, "step": d["step"], "reason": str(d.get("reason", "")),
                    "healed": healed})
    return out

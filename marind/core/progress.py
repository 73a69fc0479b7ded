"""The progress record each worker rank leaves for its local marind agent: one definition.

Where: ``$MARIND_RUN_DIR/progress/rank-{global_rank}.json`` (:func:`record_path`), one file
per rank, rewritten atomically (``marind.core.jsonfile``: a spare swapped in, so a full disk
does not stop it; a temp file renamed over it where there is no spare yet) at start, after every
optimizer step and at the end. A write that finds the disk full anyway is skipped (the next
update writes the record whole): a worker never fails for its progress record. Written by :class:`ProgressWriter` (the
reference trainer, any worker), read by the agent (``marind.agent.progress``) and by
``marind.agent.ft.coordinator`` for the torchft fields.

The JSON object, in this key order::

    {"rank", "local_rank", "world_size", "pid", "step", "loss", "tokens_per_s",
     "last_checkpoint_step", "phase", "updated_at"}

plus, in torchft mode only (``[fault] mode = "torchft"``), keys that are absent otherwise:
``replica_group`` once the worker knows its group; ``participants``, ``replica_rank``,
``quorum_id``, ``lighthouse_epoch``, ``manager_rebuilds`` together once it has been through
a quorum; ``param_digest`` in its final record; ``drift`` once a replica-drift check found this
group's state differing. ``compute_s`` (any mode, where the program measures it: the reference
trainer does) is this rank's compute time of its last step, time waiting in collectives left out;
the agents compare it across the job (stragglers). ``checkpoint_error`` (any mode) is there
while the latest checkpoint save failed (its reason). ``restore`` (elastic mode with memory
checkpoints) says where the run restored from once it did. ``phase_s`` (any mode, written by
:class:`ProgressWriter`) is the seconds this process spent in each phase up to ``updated_at``:
the goodput ledger charges the time between two records of one process from it, exactly, where the
agent saw only some of the records. :class:`ProgressRecord` documents each field.
``metrics`` (an object of name -> number: a program's own metrics, ``marind.worker.report``'s
keyword arguments) comes last when set and is absent otherwise.

Reading is tolerant: a missing, half-written or foreign file is skipped, absent optional
keys take their defaults, and ``phase`` is not checked (only the writer checks it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marind.core.disk import is_disk_full
from marind.core.jsonfile import read_json_object, write_json_atomic

#: A worker's phases, in the order a run goes through them.
PHASES = ("starting", "restoring", "training", "checkpointing", "done")

#: The torchft fields written together once the worker has been through a quorum.
QUORUM_FIELDS = ("participants", "replica_rank", "quorum_id", "lighthouse_epoch", "manager_rebuilds")


def progress_dir(run_dir: str | Path) -> Path:
    """The directory of a run's progress records: ``{run_dir}/progress``."""
    return Path(run_dir) / "progress"


def record_path(run_dir: str | Path, rank: int) -> Path:
    """The record of global rank ``rank``: ``{run_dir}/progress/rank-{rank}.json``."""
    return progress_dir(run_dir) / f"rank-{rank}.json"


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _metrics(value: Any) -> dict[str, float] | None:
    """A record's ``metrics`` as read: a non-object, or an entry that is not a number, is dropped."""
    if not isinstance(value, dict):
        return None
    out = {}
    for name, v in value.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(name)] = float(v)
    return out


def _phase_seconds(value: Any) -> dict[str, float] | None:
    """A record's ``phase_s`` as read: only the known phases, each a non-negative number; else None."""
    if not isinstance(value, dict):
        return None
    out = {}
    for name, v in value.items():
        if name in PHASES and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
            out[name] = float(v)
    return out


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's progress, as written to its record file.

    Attributes:
        rank: global rank of the worker (torchrun's ``RANK``).
        local_rank: its rank on this node.
        world_size: the torch world's size (in torchft mode: of this replica group).
        pid: the worker's process id (the agent keeps only records of its live workers).
        step: optimizer steps completed (the step the next save would hold).
        loss: mean loss of the last step, None before the first.
        tokens_per_s: job-wide tokens per second of the last step, None before the first.
        last_checkpoint_step: latest committed (or restored) checkpoint step, None if none.
        phase: one of :data:`PHASES`.
        updated_at: wall-clock time (``time.time()``) of the write.
        replica_group: torchft: this group's slot, 0..replica_groups-1.
        participants: torchft: replica groups in the last quorum.
        replica_rank: torchft: this group's rank in that quorum (None while not participating).
        quorum_id: torchft: the lighthouse's id of that quorum.
        lighthouse_epoch: torchft: epoch of the lighthouse the worker follows.
        manager_rebuilds: torchft: times the worker rebuilt its Manager after a failed quorum.
        param_digest: torchft, final record only: sha256 over this rank's local parameter shards
            (equal across groups iff they hold the same parameters).
        compute_s: seconds this rank computed in its last step (forward, backward, optimizer step;
            time waiting in collectives left out); None when the program does not measure it.
        drift: torchft: the last replica-drift finding of this group (``{"step", "reason",
            "healed"}``, ``marind.trainer.ft.drift``); None while there was none.
        checkpoint_error: why the latest checkpoint save failed, in words (the kind, e.g. a full
            checkpoint volume, and the fix: ``ckpt_store.errors.failure_reason``); None once a
            later save committed, or while none failed.
        restore: global rank 0, with memory checkpoints (``[checkpoint] memory_every``): where the run
            restored from, ``{"source": "memory"|"durable"|"none", "step", "reason", "fallback"}``
            (``marind.trainer.memory_ckpt.pick_restore``); ``fallback``: a newer memory step was lost.
        phase_s: seconds the writing process spent in each phase (name -> seconds) from the
            record's making to ``updated_at``: the time between two writes counts for the phase the
            first one announced, so the values add up to the process's time since the record was
            made; None from a writer that predates the field.
        metrics: the program's own metrics of its last report (name -> number), None if it
            gave none (``marind.worker.report(step, lr=..., grad_norm=...)``). A reader that
            predates the field ignores it; a malformed entry is dropped on reading.
    """

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
    replica_group: int | None = None
    participants: int | None = None
    replica_rank: int | None = None
    quorum_id: int | None = None
    lighthouse_epoch: int | None = None
    manager_rebuilds: int | None = None
    param_digest: str | None = None
    compute_s: float | None = None
    drift: dict[str, Any] | None = field(default=None, hash=False)
    checkpoint_error: str | None = None
    restore: dict[str, Any] | None = field(default=None, hash=False)
    phase_s: dict[str, float] | None = field(default=None, hash=False)
    metrics: dict[str, float] | None = field(default=None, hash=False)   # records stay hashable

    def to_dict(self) -> dict[str, Any]:
        """The JSON object on disk (torchft keys only where set; see the module docstring).

        Returns:
            A dict in the record's key order.
        """
        out = dataclasses.asdict(self)
        if self.replica_group is None:
            del out["replica_group"]
        if self.participants is None:
            for key in QUORUM_FIELDS:
                del out[key]
        if self.param_digest is None:
            del out["param_digest"]
        for key in ("compute_s", "drift", "checkpoint_error", "restore", "phase_s"):
            if out[key] is None:
                del out[key]
        if self.metrics is None:
            del out["metrics"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProgressRecord:
        """Parse a record; only ``rank`` is required, absent keys take their defaults.

        Args:
            d: the decoded JSON object.

        Returns:
            The record.

        Raises:
            KeyError: ``rank`` is missing.
            ValueError, TypeError: a field does not convert to its type.
        """
        return cls(rank=int(d["rank"]), local_rank=int(d.get("local_rank", 0)),
                   world_size=int(d.get("world_size", 0)), pid=int(d.get("pid", 0)),
                   step=int(d.get("step", 0)), loss=_opt_float(d.get("loss")),
                   tokens_per_s=_opt_float(d.get("tokens_per_s")),
                   last_checkpoint_step=_opt_int(d.get("last_checkpoint_step")),
                   phase=str(d.get("phase", "training")), updated_at=float(d.get("updated_at", 0.0)),
                   replica_group=_opt_int(d.get("replica_group")),
                   participants=_opt_int(d.get("participants")),
                   replica_rank=_opt_int(d.get("replica_rank")),
                   quorum_id=_opt_int(d.get("quorum_id")),
                   lighthouse_epoch=_opt_int(d.get("lighthouse_epoch")),
                   manager_rebuilds=_opt_int(d.get("manager_rebuilds")),
                   param_digest=None if d.get("param_digest") is None else str(d["param_digest"]),
                   compute_s=_opt_float(d.get("compute_s")),
                   drift=d["drift"] if isinstance(d.get("drift"), dict) else None,
                   checkpoint_error=None if d.get("checkpoint_error") is None else str(d["checkpoint_error"]),
                   restore=d["restore"] if isinstance(d.get("restore"), dict) else None,
                   phase_s=_phase_seconds(d.get("phase_s")),
                   metrics=_metrics(d.get("metrics")))


def write_record(path: Path, record: ProgressRecord) -> None:
    """Atomically replace ``path`` with ``record`` (its directory must exist).

    Raises:
        OSError: the file could not be written.
    """
    write_json_atomic(path, record.to_dict())


def read_record(path: Path) -> ProgressRecord | None:
    """The record in ``path``; None when it is missing, half written or not a record."""
    d = read_json_object(path)
    if d is None:
        return None
    try:
        return ProgressRecord.from_dict(d)
    except (ValueError, KeyError, TypeError):
        return None


def read_records(run_dir: str | Path) -> list[ProgressRecord]:
    """Every readable record of a run, by file name (a half-written or foreign file is skipped).

    Args:
        run_dir: the run directory (``$MARIND_RUN_DIR``).

    Returns:
        The records, in the order of their file names.
    """
    directory = progress_dir(run_dir)
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("rank-*.json")):
        record = read_record(path)
        if record is not None:
            out.append(record)
    return out


def add_phase_time(record: ProgressRecord, now: float, phase: str | None = None, step: int | None = None) -> dict[str, float]:
    """``record.phase_s`` with the time from its write to ``now`` added to its phase: what the next write
    of the same process carries, in ``phase`` at ``step`` (default: the record's). Time in training
    that ended in ``done`` with no further step counts as ``done`` (the worker finishing, not a step);
    a clock that went back adds nothing."""
    out = dict(record.phase_s or {})
    spent = record.phase
    if spent == "training" and phase == "done" and (step is None or step == record.step):
        spent = "done"
    out[spent] = round(out.get(spent, 0.0) + max(0.0, now - record.updated_at), 6)
    return out


class ProgressWriter:
    """Keeps one rank's record and rewrites its file on every update.

    Args:
        rank: global rank.
        local_rank: rank on this node.
        world_size: size of the torch world.
        run_dir: the run directory; None keeps the record in memory only (no file).
    """

    def __init__(self, rank: int, local_rank: int, world_size: int, run_dir: str | Path | None):
        self.path = record_path(run_dir, rank) if run_dir else None
        self.record = ProgressRecord(rank=rank, local_rank=local_rank, world_size=world_size, pid=os.getpid(),
                                     step=0, loss=None, tokens_per_s=None, last_checkpoint_step=None,
                                     phase="starting", updated_at=time.time(), phase_s={})
        self.dropped = 0          # writes skipped on a full disk
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def update(self, **fields: Any) -> None:
        """Set ``fields`` (names of :class:`ProgressRecord`), stamp ``updated_at``, rewrite the file.

        A full disk (ENOSPC, EDQUOT) is not an error: the record is kept and written by the next
        update that fits (``dropped`` counts the writes skipped).

        Raises:
            ValueError: ``phase`` is not one of :data:`PHASES`.
            TypeError: a name is not a field of the record.
            OSError: the file could not be written for another reason.
        """
        if "phase" in fields and fields["phase"] not in PHASES:
            raise ValueError(f"unknown phase {fields['phase']!r}")
        now = time.time()
        self.record = dataclasses.replace(self.record, **fields, updated_at=now,
                                          phase_s=add_phase_time(self.record, now, fields.get("phase"),
                                                                 fields.get("step")))
        if self.path:
            try:
                write_record(self.path, self.record)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                self.dropped += 1

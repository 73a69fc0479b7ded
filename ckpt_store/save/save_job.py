"""SaveJob: what ``CheckpointStore.save`` hands its writer, and the writer's interface.

One frozen record per save and rank: the step and where it goes, this rank's
place in the world, the commit and retention settings, the arrays' specs and
layouts (as the manifest records them), the JSON values, and the slots of the
snapshot arena this rank writes. It crosses to the writer process as JSON
(``to_json``/``from_json``), never pickled. Torch-free: the writer process
imports it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt_store.save.pending import PendingSave


@dataclass(frozen=True)
class Slot:
    """One chunk this rank writes: object ``key`` of ``array``, ``nbytes`` at ``offset`` in the
    arena (a whole chunk-shaped slot), of which the first ``valid_rows`` rows are inside the array."""

    key: str
    array: str
    offset: int
    nbytes: int
    valid_rows: int

    def to_json(self) -> dict:
        """This slot as a JSON object."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Slot:
        """The slot ``to_json`` made."""
        return cls(key=d["key"], array=d["array"], offset=d["offset"], nbytes=d["nbytes"],
                   valid_rows=d["valid_rows"])


@dataclass(frozen=True)
class SaveJob:
    """One rank's part of one save, for its writer.

    Attributes:
        step: the step saved; ``dir``: its directory under the store root.
        rank, world: this rank and the number of ranks saving.
        fmt: the checkpoint format written (``manifest.FORMAT``).
        commit_timeout_s: how long rank 0 waits for the parts, and the others for the commit.
        values: this rank's JSON values (the state's non-tensor leaves).
        arrays: {name: ArraySpec JSON plus its "layout"}, every array of the save.
        saved_layout: the manifest's "world" record ({world_size, saved_at}).
        keep_last, keep_every: retention, which rank 0 applies after the commit.
        background: an async save (nobody waits on its latency: poll an object store less).
        background_nice: niceness of the threads that encode and write (0: full priority).
        slots: the chunks this rank writes, in copy order; ``arena_size``: the arena's size.
        fence: ``(fence file, margin_s)`` that rank 0 checks before the manifest, or None.
    """

    step: int
    dir: str
    rank: int
    world: int
    fmt: int
    commit_timeout_s: float
    values: dict
    arrays: dict[str, dict]
    saved_layout: dict
    keep_last: int | None = None
    keep_every: int | None = None
    background: bool = False
    background_nice: int = 0
    slots: tuple[Slot, ...] = ()
    arena_size: int = 0
    fence: tuple[str, float] | None = None

    def with_slots(self, slots: list[Slot], arena_size: int) -> SaveJob:
        """This job with the arena laid out (``snapshot.reserve``)."""
        return dataclasses.replace(self, slots=tuple(slots), arena_size=arena_size)

    def layouts(self) -> dict[str, dict]:
        """{array name: its layout record}."""
        return {name: meta["layout"] for name, meta in self.arrays.items()}

    def to_json(self) -> dict:
        """This job as a JSON object (``json.dumps`` raises TypeError on a value that is not JSON)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["slots"] = [s.to_json() for s in self.slots]
        return out

    @classmethod
    def from_json(cls, d: dict) -> SaveJob:
        """The job ``to_json`` made."""
        return cls(step=d["step"], dir=d["dir"], rank=d["rank"], world=d["world"], fmt=d["fmt"],
                   commit_timeout_s=d["commit_timeout_s"], values=d["values"], arrays=d["arrays"],
                   saved_layout=d["saved_layout"], keep_last=d.get("keep_last"),
                   keep_every=d.get("keep_every"), background=d.get("background", False),
                   background_nice=d.get("background_nice", 0),
                   slots=tuple(Slot.from_json(s) for s in d.get("slots", ())),
                   arena_size=d.get("arena_size", 0),
                   fence=(str(d["fence"][0]), float(d["fence"][1])) if d.get("fence") else None)


class SaveWriter(Protocol):
    """Where the background part of a save runs (``ThreadWriter``, ``ProcessWriter``).

    Jobs run one at a time, in order; each job's ``PendingSave`` is finished once
    it committed (and, on rank 0, retention ran) or failed.
    """

    @property
    def pid(self) -> int | None:
        """The writer process's pid (None: a thread, or no process yet)."""
        ...

    def submit(self, job: SaveJob, pending: PendingSave) -> None:
        """Queue ``job``; its snapshot is copied afterwards (``copied``, ``copy_failed``)."""
        ...

    def copied(self, slots: int, complete: bool = False) -> None:
        """The first ``slots`` slots of the latest job hold their data; ``complete``: all, and sound."""
        ...

    def copy_failed(self, error: str) -> None:
        """The latest job's copy failed: its part fails (never commits)."""
        ...

    def cancel(self, step: int, error: str) -> None:
        """The ranks agreed that the save of ``step`` (the latest job) failed: its part stops
        (writing, or waiting for a commit that will not come) and fails with ``error``."""
        ...

    def close(self) -> None:
        """Finish the queued jobs and stop."""
        ...


def writer_kind(writer: str, in_process: bool, storage_options: Any) -> str:
    """Which writer a store uses: "process" or "thread".

    Args:
        writer: the store's ``writer`` argument: "auto", "process" or "thread".
        in_process: the store's objects live in this process (memory://).
        storage_options: the store's fsspec options (the process gets them as JSON).

    Returns:
        ``writer``, or for "auto": "thread" for memory:// and options that are not JSON,
        else "process".

    Raises:
        ValueError: an unknown ``writer``, or "process" for memory://.
    """
    if writer not in ("auto", "process", "thread"):
        raise ValueError(f"writer={writer!r}: use 'auto', 'process' or 'thread'")
    if in_process:
        if writer == "process":
            raise ValueError("writer='process' cannot write a memory:// store (it lives in this process)")
        return "thread"
    if writer == "auto":
        try:
            json.dumps(storage_options)
        except (TypeError, ValueError):
            return "thread"
        return "process"
    return writer

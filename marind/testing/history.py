"""A scenario's history, and the one checker of the invariants every fault must keep.

Every chaos and bed scenario records what happened (``collect``): the job's final state, its
events (rounds, restarts, lost, fenced and rejoined nodes, each commit), and for each committed
checkpoint its manifest, with the world that made it and the fence it was allowed on (the lease
file's ``valid_until`` and ``node``, ``checked_at``: docs/design.md §4). ``check`` then verifies,
the same way for every scenario, old and new:

1. every committed checkpoint verifies (every object re-read, sizes and checksums) and loads
   (every array read whole);
2. no step was committed by two worlds (one ``checkpoint_committed`` per step; in torchft mode,
   where each replica group's rank-0 node reports the commits it sees, one per step and node);
3. every commit was made by a world that held its lease at commit time: its fence's
   ``checked_at`` inside ``valid_until``, and its node not declared lost or fenced before the
   commit without joining again in between (under an agent, a commit without a fence is one);
4. no committed checkpoint was lost except by retention (every step seen committed that the
   retention rule keeps is still there);
5. the job ended as expected (its state and step) and, where the mode promises it, its final
   state is bit-identical to a fault-free run's.

``check`` returns the violations in words (empty: the history holds). Reading the store goes
through ``ckpt_store``'s public surface only.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ckpt_store import CheckpointError, CheckpointStore
from ckpt_store.export import read_array, read_values
from marind.control.events import list_events
from marind.core.etcd_client import EtcdClient
from marind.testing.chaos.targets import parse_time

#: events after which a node is out of its world, and those that bring it back into a new one
_OUT = ("node_lost", "host_fenced")
_BACK = ("node_joined", "node_rejoined")


@dataclass
class History:
    """What one job's run left behind: etcd's view of it and the store's."""

    job: str
    state: dict
    events: list[dict]
    steps: list[int]
    manifests: dict[int, dict]
    seen_committed: list[int] = field(default_factory=list)
    keep_last: int | None = None
    keep_every: int | None = None
    mode: str = "elastic"
    collected_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def collect(client: EtcdClient, job: str, store: CheckpointStore, *, seen_committed: tuple[int, ...] | list[int] = (),
            keep_last: int | None = None, keep_every: int | None = None) -> History:
    """Read a job's history from etcd and its store (after the job ended, or at any moment).

    Args:
        client: a client on the job's etcd prefix.
        job: the job id.
        store: the job's checkpoint store.
        seen_committed: steps the scenario saw committed while it ran (polled), beside the
            ``checkpoint_committed`` events.
        keep_last, keep_every: the job's retention; None: the job's own ``[checkpoint]`` settings
            (0 or absent: keep all).

    Returns:
        The history.
    """
    events = list_events(client, job)
    state = client.get_json(client.key("jobs", job, "state")) or {}
    stored = client.get_json(client.key("jobs", job, "spec")) or {}
    spec = stored.get("spec", stored) if isinstance(stored, dict) else {}
    mode = str((spec.get("fault") or {}).get("mode", "elastic"))
    ckpt = spec.get("checkpoint") or {}
    keep_last = ckpt.get("keep_last") if keep_last is None else keep_last       # the job's own retention
    keep_every = ckpt.get("keep_every") if keep_every is None else keep_every
    steps = store.steps()
    manifests = {}
    for step in steps:
        try:
            manifests[step] = store.manifest(step)
        except CheckpointError as exc:
            manifests[step] = {"error": str(exc)}
    seen = sorted(set(seen_committed) | {int(e["detail"]["step"]) for e in events
                                         if e.get("kind") == "checkpoint_committed"
                                         and isinstance(e.get("detail"), dict) and "step" in e["detail"]})
    return History(job=job, state=state, events=events, steps=steps, manifests=manifests,
                   seen_committed=seen, keep_last=keep_last or None, keep_every=keep_every or None, mode=mode)


def check(history: History, store: CheckpointStore | None = None, *, expect_state: str | None = "SUCCEEDED",
          expect_step: int | None = None, require_fence: bool = True,
          final_objects: dict | None = None, baseline_objects: dict | None = None) -> list[str]:
    """The invariants of a history (module docstring); the violations, in words.

    Args:
        history: what ``collect`` read.
        store: the job's store, to verify and load every committed step (None: skip 1).
        expect_state: the job's expected final state (None: any).
        expect_step: the last committed step expected (None: any).
        require_fence: every commit must carry a fence record (a job under an agent).
        final_objects, baseline_objects: the final checkpoint's tensor bytes and a fault-free
            run's, where the mode promises bit-identical results (None: not compared).
    """
    out: list[str] = []
    if store is not None:
        out += _loads(history, store)
    out += _committed_once(history)
    out += _fenced(history, require_fence)
    out += _kept(history)
    if expect_state is not None and history.state.get("state") != expect_state:
        out.append(f"the job ended {history.state.get('state')!r} ({history.state.get('reason', '')}), "
                   f"expected {expect_state}")
    if expect_step is not None and (not history.steps or history.steps[-1] != expect_step):
        out.append(f"the last committed step is {history.steps[-1] if history.steps else None}, "
                   f"expected {expect_step}")
    if final_objects is not None and baseline_objects is not None and final_objects != baseline_objects:
        differ = sorted(k for k in set(final_objects) | set(baseline_objects)
                        if final_objects.get(k) != baseline_objects.get(k))
        out.append(f"the final state differs from the fault-free run's in {len(differ)} object(s), "
                   f"e.g. {differ[:3]}")
    return out


def _loads(history: History, store: CheckpointStore) -> list[str]:
    out = []
    for step in history.steps:
        report = store.verify(step)
        if not report.ok:
            out.append(f"committed step {step} does not verify: {report.problems[:3]}")
            continue
        try:
            manifest = history.manifests[step]
            for name, meta in manifest.get("arrays", {}).items():
                read_array(store, step, name, meta)
            read_values(store, step)
        except (CheckpointError, OSError, ValueError, KeyError) as exc:
            out.append(f"committed step {step} does not load: {type(exc).__name__}: {exc}")
    return out


def _committed_once(history: History) -> list[str]:
    per_node = history.mode == "torchft"
    seen: dict[tuple, list[dict]] = {}
    for e in history.events:
        if e.get("kind") == "checkpoint_committed" and isinstance(e.get("detail"), dict) and "step" in e["detail"]:
            seen.setdefault((int(e["detail"]["step"]), e.get("node") if per_node else None), []).append(e)
    return [f"step {key[0]} was committed {len(rows)} times (by {[r.get('node') for r in rows]}): two worlds"
            for key, rows in sorted(seen.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))) if len(rows) > 1]


def _fenced(history: History, require_fence: bool) -> list[str]:
    out = []
    for step, manifest in sorted(history.manifests.items()):
        fence = manifest.get("fence")
        if not fence:
            if require_fence and "error" not in manifest:
                out.append(f"step {step} was committed without a fence (no lease file checked)")
            continue
        checked, until = float(fence["checked_at"]), float(fence["valid_until"])
        if checked > until:
            out.append(f"step {step} was committed at {checked:.3f}, after its world's lease ran out "
                       f"({until:.3f})")
        node = fence.get("node")
        if node:
            out += _node_out_at_commit(history, step, node, checked)
    return out


def _node_out_at_commit(history: History, step: int, node: str, checked: float) -> list[str]:
    """Was ``node`` out of its world (lost or fenced, not joined again) when it committed?"""
    out_since: float | None = None
    for e in history.events:
        at = parse_time(e.get("at"))
        if at is None or at > checked:
            continue
        raw = e.get("detail")
        detail: dict = raw if isinstance(raw, dict) else {}
        if e.get("kind") == "node_lost" and detail.get("node") == node:
            out_since = at
        elif e.get("kind") == "host_fenced" and e.get("node") == node:
            fenced_at = parse_time(detail.get("fenced_at")) or at
            out_since = fenced_at if fenced_at <= checked else out_since
        elif e.get("kind") in _BACK and e.get("node") == node and out_since is not None and at >= out_since:
            out_since = None
    if out_since is None:
        return []
    return [f"step {step} was committed by node {node} at {checked:.3f}, which was out of its world since "
            f"{out_since:.3f} (lost or fenced, not joined again)"]


def _kept(history: History) -> list[str]:
    # the store's steps are committed too: the newest commits of a job that ended before its agent
    # reported them (no event) still push the older ones out of keep_last
    seen = sorted(set(history.seen_committed) | set(history.steps))
    if not seen:
        return []
    keep = set(seen if history.keep_last is None else seen[-history.keep_last:])
    if history.keep_every:
        keep |= {s for s in seen if s % history.keep_every == 0}
    if history.keep_last is None and history.keep_every is None:
        keep = set(seen)
    missing = sorted(keep - set(history.steps))
    return [f"committed step(s) {missing} are gone though retention keeps them"] if missing else []


# -- the faults table: one row per scenario ------------------------------------------------------

def step_timeline(log_paths: list[Path]) -> list[tuple[float, int]]:
    """(Unix time, step) of every training step the trainer logged (global rank 0's ``step``
    lines in the nodes' ``torchrun.log``), a redone step as often as it ran, by time."""
    rows = []
    for path in log_paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if '"event": "step"' not in line or "{" not in line:
                continue
            try:
                rec = json.loads(line[line.index("{"):])
                at = parse_time(rec.get("timestamp"))
                if at is not None:
                    rows.append((at, int(rec["step"])))
            except (ValueError, KeyError, TypeError):
                continue
    return sorted(set(rows))


def steps_run_again(timelines: list[list[tuple[float, int]]], mode: str | None) -> int:
    """Training steps that ran a second time (after a restore or a rollback), from each node's
    ``step_timeline``. Elastic: over the nodes together (global rank 0 moves between nodes);
    torchft: within each node's (each replica group's rank 0 logs every step it commits, and the
    groups run every step side by side)."""
    def again(timeline: list[tuple[float, int]]) -> int:
        steps = [s for _, s in timeline]
        return len(steps) - len(set(steps))

    if mode == "torchft":
        return sum(again(t) for t in timelines)
    return again(merge_timelines(timelines))


def merge_timelines(timelines: list[list[tuple[float, int]]]) -> list[tuple[float, int]]:
    """Nodes' ``step_timeline``s as one (``step_timeline`` of all their logs)."""
    return sorted({row for t in timelines for row in t})


def fault_row(scenario: str, history: History, timeline: list[tuple[float, int]], problems: list[str],
              baseline_span_s: float | None = None, again_s: float | None = None,
              steps_lost: int | None = None) -> dict:
    """A row of the faults table: the scenario, its outcome, restarts, the time the faults cost,
    steps lost (steps run again after a rollback), checkpoints lost and invariant violations; and
    ``again_s``, where the scenario measured it: seconds from its fault until the job stepped again.
    ``steps_lost``: ``steps_run_again`` of the nodes' timelines (default: the timeline's repeated step numbers).

    The time lost is the run's span from its first to its last training step less a fault-free
    run's (``baseline_span_s``); without one, the longest pause between two steps less a median
    step (a fault-free run pauses too: a save waiting for the one before it).
    """
    gaps = sorted(b[0] - a[0] for a, b in zip(timeline, timeline[1:]))
    if baseline_span_s is not None and timeline:
        recovery: float | None = max(0.0, timeline[-1][0] - timeline[0][0] - baseline_span_s)
    elif gaps:
        recovery = max(0.0, gaps[-1] - gaps[len(gaps) // 2])
    else:
        recovery = None
    steps = [s for _, s in timeline]
    lost_ckpts = sum(len(p.split("] are gone")[0].split(",")) for p in problems if "] are gone" in p)
    return {"scenario": scenario, "state": history.state.get("state"), "restarts": history.state.get("restarts", 0),
            "recovery_s": None if recovery is None else round(recovery, 1),
            "steps_lost": len(steps) - len(set(steps)) if steps_lost is None else steps_lost,
            "checkpoints_lost": lost_ckpts,
            "violations": len(problems), "again_s": None if again_s is None else round(again_s, 1)}


def timeline_span(timeline: list[tuple[float, int]]) -> float | None:
    """Seconds from the first training step to the last (None without two)."""
    return timeline[-1][0] - timeline[0][0] if len(timeline) > 1 else None


def append_row(path: str | Path, row: dict) -> None:
    """Add a row to a faults-table file (JSON lines; ``tools/faults_table.py`` renders it)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")

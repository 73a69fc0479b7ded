"""Stragglers: a rank persistently slower than the rest of its job is named (docs/design.md §2, §11).

In synchronous training every rank's step takes the slowest rank's time, so the step time names
nobody. Each rank's progress record carries its own compute time of the last step (``compute_s``:
forward, backward and optimizer step, time waiting in collectives left out;
``marind.trainer.compute_time``). From there:

* every agent samples its ranks' ``compute_s`` (one sample per new step seen, ``ComputeWindow``)
  over ``fault.straggler_window`` and publishes each rank's median, sample count and how long it
  has been watched to ``{p}/jobs/{job}/compute/{node}`` every ``PUBLISH_S``;
* the agent that runs the job's rank 0 (replica group 0's under torchft) reads every node's
  summary every ``PUBLISH_S`` and decides (:func:`decide_stragglers`, pure): a rank watched for a
  whole window whose median is above ``fault.straggler_factor`` times the median of the other
  ranks' medians is a straggler. Each one that appears is a ``straggler`` event (its node and
  ranks, their compute time, the others' median, the factor); one that recovers is
  ``straggler_cleared``; the current set is ``{p}/jobs/{job}/stragglers`` (``marind status``) and the
  metric ``marind_job_stragglers``; every agent sets ``marind_job_compute_seconds`` (its ranks'
  median).

The comparison leaves the rank itself out of the median it is held against, so that in a job of
two ranks a slow one is compared with the other (with itself in, it could never be 1.5x a
median it is half of). Summaries older than two windows (a node gone) are not counted.

With ``[fault] straggler_action = "exclude"`` the deciding agent also takes the node of the slowest
new straggler out of the job when the job keeps its minimum node count without it
(``marind.control.job_exclusions``: the key, a ``straggler_excluded`` event, and the jobs marked
changed so that every agent reads them at once); that node's agent leaves the job
(:func:`excluded_here`, ``Agent._reconcile``) and the others go on in a new round without it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.progress import ProgressRecord
from marind.control.events import STRAGGLER, STRAGGLER_CLEARED, STRAGGLER_EXCLUDED
from marind.control.job_exclusions import exclude, excluded_nodes, exclusion_decision, exclusion_of
from marind.control.job_records import JobView, job_nodes, mark_jobs_changed, parse_stored_spec
from marind.core.errors import ControlPlaneUnavailable
from marind.core.log import get_logger
from marind.core.spec import FaultSpec, RunSpec

PUBLISH_S = 2.0        # how often a node publishes its summary, and the decider decides
MIN_SAMPLES = 5        # a rank needs this many samples in its window to be judged


@dataclass(frozen=True)
class RankCompute:
    """One rank's compute time over the window, as its node published it.

    Attributes:
        median_s: median of its ``compute_s`` samples in the window.
        samples: how many samples that is.
        watched_s: how long it has been watched (a full window is needed to be judged).
    """

    median_s: float
    samples: int
    watched_s: float


@dataclass(frozen=True)
class StragglerDecision:
    """The stragglers (rank id -> its median compute seconds), the job's median, and why."""

    stragglers: dict[str, float] = field(default_factory=dict)
    median_s: float | None = None
    reason: str = ""


def decide_stragglers(ranks: Mapping[str, RankCompute], *, factor: float, window: float,
                      min_samples: int = MIN_SAMPLES) -> StragglerDecision:
    """Name the ranks persistently slower than the others.

    Args:
        ranks: rank id (``node/rank``) -> its compute summary.
        factor: ``fault.straggler_factor`` (> 1).
        window: ``fault.straggler_window`` (seconds): a rank watched for less is not judged.
        min_samples: fewer samples in the window are not judged either.

    Returns:
        The stragglers: each judged rank whose median is above ``factor`` x the median of the
        other judged ranks' medians; the median of every judged rank's median; the reason.
    """
    judged = {r: c.median_s for r, c in ranks.items() if c.samples >= min_samples and c.watched_s >= window}
    if len(judged) < 2:
        return StragglerDecision(reason=f"{len(judged)} rank(s) watched for a whole {window:g}s window: "
                                        "nothing to compare")
    out: dict[str, float] = {}
    worst = ""
    for rank, median in sorted(judged.items()):
        others = statistics.median(v for r, v in judged.items() if r != rank)
        if others > 0 and median > factor * others:
            out[rank] = median
            worst = worst or f"{rank} computes {median:.3g}s per step, {median / others:.1f}x the others' " \
                             f"median {others:.3g}s (> {factor:g}x over {window:g}s)"
    job_median = statistics.median(judged.values())
    if not out:
        return StragglerDecision({}, job_median, f"{len(judged)} ranks within {factor:g}x of each other")
    more = f" (and {len(out) - 1} more)" if len(out) > 1 else ""
    return StragglerDecision(out, job_median, worst + more)


class ComputeWindow:
    """This node's ranks' ``compute_s`` samples over the last ``window`` seconds."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: dict[int, deque[tuple[float, float]]] = {}
        self._since: dict[int, float] = {}          # rank -> when its current worker was first seen
        self._last: dict[int, tuple[int, int]] = {}   # rank -> (pid, step) of its last sample

    def reset(self) -> None:
        """A new round: ranks are numbered afresh."""
        self._samples.clear()
        self._since.clear()
        self._last.clear()

    def observe(self, records: list[ProgressRecord], now: float) -> None:
        """Take one sample per rank whose record shows a new step with a ``compute_s``."""
        for r in records:
            if r.compute_s is None or r.phase != "training":
                continue
            mark = (r.pid, r.step)
            if self._last.get(r.rank) == mark:
                continue
            if self._last.get(r.rank, (r.pid,))[0] != r.pid:      # a new worker on this rank
                self._samples.pop(r.rank, None)
                self._since.pop(r.rank, None)
            self._last[r.rank] = mark
            self._since.setdefault(r.rank, now)
            self._samples.setdefault(r.rank, deque()).append((now, r.compute_s))
        for q in self._samples.values():
            while q and now - q[0][0] > self.window:
                q.popleft()

    def summary(self, now: float) -> dict[int, RankCompute]:
        """Rank -> its summary (ranks with samples in the window only)."""
        return {rank: RankCompute(round(statistics.median(c for _, c in q), 6), len(q), round(now - self._since[rank], 3))
                for rank, q in self._samples.items() if q}


def compute_key(client: Any, job: str, node: str | None = None) -> str:
    """``{p}/jobs/{job}/compute/{node}`` (without ``node``: the prefix, ending in ``/``)."""
    return client.key("jobs", job, "compute", node) if node else client.key("jobs", job, "compute") + "/"


def stragglers_key(client: Any, job: str) -> str:
    """``{p}/jobs/{job}/stragglers``: the current set, for ``marind status``."""
    return client.key("jobs", job, "stragglers")


class StragglerWatch:
    """One job's straggler watch on this node (fed by ``RunProgress.observe`` every tick).

    Args:
        job: the job's id.
        outbox: this node's outbox (its etcd client, its node name, the events).
        metrics: the agent's metrics.
        factor, window, action: ``fault.straggler_factor``, ``fault.straggler_window`` and
            ``fault.straggler_action``; min_nodes: ``job.nodes``' minimum. None: read from the job's
            stored spec at the first tick (defaults when it cannot be read).
    """

    def __init__(self, job: str, outbox: Outbox, metrics: Metrics, *, factor: float | None = None,
                 window: float | None = None, action: str | None = None, min_nodes: int | None = None) -> None:
        self.job, self.outbox, self.metrics = job, outbox, metrics
        self.factor: float | None = factor
        self.window: float | None = window
        self.action: str | None = action
        self.min_nodes: int | None = min_nodes
        self.samples: ComputeWindow | None = None
        self.current: dict[str, float] = {}          # the stragglers named now
        self._next = 0.0
        self.log = get_logger(__name__, job=job, node=outbox.node)

    def _settings(self) -> ComputeWindow:
        if self.samples is None:
            if None in (self.factor, self.window, self.action, self.min_nodes):
                spec = _stored_spec(self.outbox.client, self.job)
                f = spec.fault if spec is not None else FaultSpec()
                self.factor = self.factor or f.straggler_factor
                self.window = self.window or f.straggler_window
                self.action = self.action or f.straggler_action
                self.min_nodes = self.min_nodes or (spec.job.nodes[0] if spec is not None else 1)
            self.samples = ComputeWindow(float(self.window or 30.0))
        return self.samples

    def new_round(self) -> None:
        """A new rendezvous round: the samples start afresh (the named set stays until decided anew)."""
        if self.samples is not None:
            self.samples.reset()

    def tick(self, records: list[ProgressRecord], now: float) -> None:
        """Sample the records; every ``PUBLISH_S``: publish, and decide where this node runs rank 0."""
        if not any(r.compute_s is not None for r in records):
            return
        samples = self._settings()
        samples.observe(records, now)
        if now < self._next:
            return
        self._next = now + PUBLISH_S
        mine = samples.summary(now)
        if mine:
            self.metrics.set("marind_job_compute_seconds", statistics.median(c.median_s for c in mine.values()),
                             job=self.job)
        client, node = self.outbox.client, self.outbox.node
        try:
            client.put_json(compute_key(client, self.job, node), {
                "ranks": {str(rank): c.__dict__ for rank, c in mine.items()}, "updated_at": now})
            if any(r.rank == 0 and (r.replica_group or 0) == 0 for r in records):
                self._decide(now)
        except ControlPlaneUnavailable:
            return

    def _decide(self, now: float) -> None:
        client, window, factor = self.outbox.client, float(self.window or 30.0), float(self.factor or 1.5)
        ranks: dict[str, RankCompute] = {}
        for key, doc in client.get_prefix_json(compute_key(client, self.job)).items():
            node = key.rsplit("/", 1)[-1]
            if not isinstance(doc, dict) or now - float(doc.get("updated_at") or 0) > 2 * window:
                continue
            for rank, c in (doc.get("ranks") or {}).items():
                try:
                    ranks[f"{node}/{rank}"] = RankCompute(float(c["median_s"]), int(c["samples"]),
                                                          float(c["watched_s"]))
                except (KeyError, TypeError, ValueError):
                    continue
        decision = decide_stragglers(ranks, factor=factor, window=window)
        self.metrics.set("marind_job_stragglers", len(decision.stragglers), job=self.job)
        if decision.stragglers.keys() == self.current.keys():
            return
        for node, named in _by_node(decision.stragglers).items():
            if not all(f"{node}/{r}" in self.current for r in named):
                self.outbox.event(self.job, STRAGGLER, {
                    "node": node, "ranks": sorted(named), "compute_s": max(named.values()),
                    "median_s": decision.median_s, "factor": factor, "window_s": window, "reason": decision.reason})
        for node, gone in _by_node({r: v for r, v in self.current.items() if r not in decision.stragglers}).items():
            self.outbox.event(self.job, STRAGGLER_CLEARED, {"node": node, "ranks": sorted(gone)})
        self.current = dict(decision.stragglers)
        self.log.warning("stragglers", named=sorted(self.current), reason=decision.reason)
        client.put_json(stragglers_key(client, self.job), {
            "ranks": [{"node": r.rsplit("/", 1)[0], "rank": int(r.rsplit("/", 1)[1]), "compute_s": v}
                      for r, v in sorted(self.current.items())],
            "median_s": decision.median_s, "factor": factor, "window_s": window, "reason": decision.reason,
            "updated_at": now})
        if self.action == "exclude" and decision.stragglers:
            self._exclude(decision)

    def _exclude(self, decision: StragglerDecision) -> None:
        """Take the slowest straggler's node out of the job, if the job keeps its minimum without it."""
        client = self.outbox.client
        out = exclusion_decision(decision.stragglers, list(job_nodes(client, self.job)), self.min_nodes or 1,
                                 excluded_nodes(client, self.job))
        if out.node is None:
            self.log.warning("straggler_kept", reason=out.reason)
            return
        named = _by_node(decision.stragglers)[out.node]
        detail = {"ranks": sorted(named), "compute_s": max(named.values()), "median_s": decision.median_s,
                  "reason": out.reason}
        if exclude(client, self.job, out.node, detail, by=self.outbox.node):
            self.outbox.event(self.job, STRAGGLER_EXCLUDED, {"node": out.node, **detail})
            mark_jobs_changed(client)          # the node's agent reads it at once
            self.log.warning("straggler_excluded", excluded=out.node, reason=out.reason)


def _by_node(ranks: Mapping[str, float]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for rid, value in ranks.items():
        node, rank = rid.rsplit("/", 1)
        out.setdefault(node, {})[int(rank)] = value
    return out


def _stored_spec(client: Any, job: str) -> RunSpec | None:
    """The job's stored spec (None when it cannot be read: the defaults apply)."""
    try:
        spec, _ = parse_stored_spec(client.get_json(client.key("jobs", job, "spec")))
    except (ControlPlaneUnavailable, ValueError):
        spec = None
    return spec


def excluded_here(client: Any, view: JobView, node: str) -> dict | None:
    """``node``'s exclusion from ``view``'s job, where the job takes stragglers' nodes out; None otherwise,
    and while etcd is away (the next read of the jobs looks again)."""
    spec = view.run_spec
    if spec is None or spec.fault.straggler_action != "exclude":
        return None
    try:
        return exclusion_of(client, view.id, node)
    except ControlPlaneUnavailable:
        return None

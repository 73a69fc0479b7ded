"""What one run's progress records told over time: its step, when it last moved, its checkpoints.

The ``RunMonitor`` keeps one ``RunProgress`` per run and hands it the current round's
records every tick (``observe``). From them it keeps

* the node's step (the furthest step its workers reached; it never goes back);
* when the round's stall marker last changed (``progress_at``) and a typical time between
  two changes (``progress_interval``, a moving average): the fence, node-loss and
  silent-host decisions read how long the workers stalled from them;
* torchft: each replica-drift finding of this node's group (``replica_drift``, when found and
  when healed);
* its ranks' compute times, for the job's straggler watch (``stragglers``);
* where rank 0's run restored from: a ``checkpoint_memory_fallback`` event when it fell back
  from a lost memory checkpoint to the durable store;
* rank 0's checkpoint commits: each one after the run's restore is a
  ``checkpoint_committed`` event, with its duration (from when rank 0 first showed the
  checkpoint's step to when its record showed the commit) and a metric;
* the per-job metrics (step, restarts, loss, tokens per second, last checkpoint);
* global rank 0's curves and what they show (``run_history``: TensorBoard, W&B,
  non-finite losses and rollbacks);
* at the run's end (``final``), the last round's step and, where global rank 0 ran,
  the job's final progress.

Reading and summarising the records is ``marind.agent.progress`` (pure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marind.agent import progress as prog
from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.run_history import RunHistory
from marind.agent.stragglers import StragglerWatch
from marind.control.events import CHECKPOINT_FAILED, CHECKPOINT_MEMORY_FALLBACK, REPLICA_DRIFT


class RunProgress:
    """One run's progress as its records showed it.

    Args:
        job: the job's id (events, metric labels).
        outbox: where ``checkpoint_committed`` events go.
        metrics: the agent's metrics.
        history: the run's curves and what they show (``run_history``); None: not followed.
    """

    def __init__(self, job: str, outbox: Outbox, metrics: Metrics, history: RunHistory | None = None):
        self.job, self.outbox, self.metrics, self.history = job, outbox, metrics, history
        self.step = 0                                   # the furthest step this node's workers reached
        self.last_ckpt_step: int | None = None
        self.progress_at: float | None = None          # when the round's stall marker last changed
        self.progress_interval: float | None = None    # a typical time between two changes (moving average)
        self._ckpt_baseline = False          # the first training record's checkpoint step is a restore
        self._step_seen_at: dict[int, float] = {}   # rank 0's steps: when its record first showed them
        self._marker: object = None
        self._fallback_seen: int | None = None   # rank 0's pid whose memory fallback was told
        self._ckpt_error: str | None = None   # rank 0's last checkpoint_error (a checkpoint_failed event each)
        self._drift_seen: dict[tuple[int, int], bool] = {}
        self.stragglers = StragglerWatch(job, outbox, metrics)

    def new_round(self) -> None:
        """A new rendezvous round: its stall marker starts afresh."""
        self._marker, self.progress_at, self.progress_interval = None, None, None
        self.stragglers.new_round()

    def observe(self, records: list[prog.ProgressRecord], now: float, *, restarts: int) -> None:
        """One tick's records of the current round: checkpoints, the stall marker, the step, the metrics.

        Args:
            records: the current round's progress records.
            now: the current time.
            restarts: the run's restarts so far (a metric).
        """
        self._watch_checkpoints(records, now)
        for detail in prog.drift_findings(records, self._drift_seen):
            self.outbox.event(self.job, REPLICA_DRIFT, detail)
        self.stragglers.tick(records, now)
        marker = prog.stall_marker(records)
        if marker is not None and marker != self._marker:
            if self.progress_at is not None:
                dt, prev = now - self.progress_at, self.progress_interval
                self.progress_interval = dt if prev is None else 0.7 * prev + 0.3 * dt
            self._marker, self.progress_at = marker, now
        self.step = prog.node_step(records) or self.step
        self._job_metrics(records, restarts)
        if self.history is not None:
            self.history.poll()

    def close(self) -> None:
        """The run ended: the curves get their last points and are closed."""
        if self.history is not None:
            self.history.close()

    def final(self, run_dir: Path, worker_pids: frozenset[int], log: Any) -> dict | None:
        """The run ended: the last round's records, read once more. ``step`` becomes the last step
        its workers reached; the job's progress (``progress.job_summary``) where global rank 0 ran.

        Args:
            run_dir: the job's run dir.
            worker_pids: the last round's workers (only their records count).
            log: the run's logger.

        Returns:
            The job's progress, or None where rank 0 did not run.
        """
        # only the last round's records: a rank file left by an earlier round (when this node
        # held global rank 0) would set the job's progress back
        records = prog.read_records(run_dir)
        final = prog.current(records, set(worker_pids))
        self.step = max(self.step, prog.node_step(final))
        summary = prog.job_summary(final)
        log.info("final_progress", step=summary and summary["step"],
                 workers=sorted(worker_pids), records={r.rank: r.pid for r in records})
        if summary is not None:
            self.step = max(self.step, summary["step"])
        return summary

    def _watch_checkpoints(self, records: list[prog.ProgressRecord], now: float) -> None:
        rank0 = next((r for r in records if r.rank == 0), None)
        if rank0 is None or rank0.phase in ("starting", "restoring"):
            return
        self._watch_restore(rank0)
        self._step_seen_at.setdefault(rank0.step, rank0.updated_at)
        if rank0.checkpoint_error and rank0.checkpoint_error != self._ckpt_error:   # each failed save once
            self.outbox.event(self.job, CHECKPOINT_FAILED, {"step": rank0.step, "reason": rank0.checkpoint_error})
        self._ckpt_error = rank0.checkpoint_error
        step = rank0.last_checkpoint_step
        if not self._ckpt_baseline:          # what the run restored, not a commit
            self._ckpt_baseline, self.last_ckpt_step = True, step
            return
        if step is None or (self.last_ckpt_step is not None and step <= self.last_ckpt_step):
            return
        started = min((t for s, t in self._step_seen_at.items() if s >= step), default=None)
        detail: dict[str, Any] = {"step": step}
        if started is not None and rank0.updated_at >= started:
            detail["duration_s"] = round(rank0.updated_at - started, 3)
            self.metrics.observe("marind_checkpoint_duration_seconds", detail["duration_s"], job=self.job)
        self.outbox.event(self.job, "checkpoint_committed", detail)
        self.last_ckpt_step = step
        self._step_seen_at = {s: t for s, t in self._step_seen_at.items() if s > step}

    def _watch_restore(self, rank0: prog.ProgressRecord) -> None:
        """A ``checkpoint_memory_fallback`` event for a restore that fell back from memory (once per
        worker process of global rank 0: each restart restores once)."""
        restore = rank0.restore
        if not restore or not restore.get("fallback") or self._fallback_seen == rank0.pid:
            return
        self._fallback_seen = rank0.pid
        self.outbox.event(self.job, CHECKPOINT_MEMORY_FALLBACK,
                          {"step": restore.get("step"), "lost_step": restore.get("lost_step"),
                           "reason": restore.get("reason")})

    def _job_metrics(self, records: list[prog.ProgressRecord], restarts: int) -> None:
        rank0 = next((r for r in records if r.rank == 0), None)
        m, job = self.metrics, self.job
        m.set("marind_job_step", rank0.step if rank0 is not None else self.step, job=job)
        m.set("marind_job_restarts_total", restarts, job=job)
        if rank0 is not None and rank0.loss is not None:
            m.set("marind_job_loss", rank0.loss, job=job)
        if rank0 is not None and rank0.tokens_per_s is not None:
            m.set("marind_job_tokens_per_second", rank0.tokens_per_s, job=job)
        if self.last_ckpt_step is not None:
            m.set("marind_job_last_checkpoint_step", self.last_ckpt_step, job=job)

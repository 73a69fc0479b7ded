"""The job's bookkeeping kept by the agent of global rank 0: progress, curves and goodput ledger.

On every report of the node that runs global rank 0 (``RunMonitor.report``), one
``JobJournal`` per run writes

* ``{p}/jobs/{job}/progress``: rank 0's record summarised (``progress.job_summary``);
* ``{p}/jobs/{job}/series``: a point per new step, bounded (``marind.control.job_series``),
  written at most every ``SERIES_EVERY_S`` seconds;
* ``{p}/jobs/{job}/ledger``: the goodput ledger's fold state (``marind.control.goodput_ledger``)
  with the events written since the last report and rank 0's record folded in, and its view;
* the counters ``marind_job_seconds_total{job, cause}`` (the time settled so far).

An agent that takes the bookkeeping over (rank 0 moved to its node) reads the stored ledger
and series once and goes on from them; one that loses it forgets its copies. In torchft mode
every replica group has a rank 0; only replica group 0's keeps the series and the ledger.
"""

from __future__ import annotations

from typing import Any

from marind.agent import progress as prog
from marind.agent.metrics import Metrics
from marind.control import goodput_ledger as gl
from marind.control import job_series
from marind.control.events import list_events
from marind.control.job_history import ledger_key, series_key
from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import round_key

#: The series is written at most this often (and on a run's last report).
SERIES_EVERY_S = 2.0


class JobJournal:
    """One run's bookkeeping where global rank 0 runs (see the module docstring).

    Args:
        job: the job's id.
        metrics: the agent's metrics (``marind_job_seconds_total``).
    """

    def __init__(self, job: str, metrics: Metrics):
        self.job, self.metrics = job, metrics
        self._state: gl.LedgerState | None = None
        self._series: dict[str, Any] | None = None
        self._series_dirty = False
        self._series_written_at = 0.0
        self._round: tuple[str, float | None] | None = None     # rank 0's pid, its round's close

    def report(self, client: EtcdClient, records: list[prog.ProgressRecord], now: float) -> dict | None:
        """Write the job's progress, series and ledger when global rank 0 runs here.

        Args:
            client: the etcd client (``ControlPlaneUnavailable`` propagates).
            records: the current round's progress records on this node.
            now: the current time.

        Returns:
            The progress summary written, or None (rank 0 does not run here).
        """
        summary = prog.job_summary(records)
        rank0 = next((r for r in records if r.rank == 0), None)
        if summary is None or rank0 is None:
            self.flush(client)
            self._state, self._series = None, None
            return None
        client.put_json(client.key("jobs", self.job, "progress"), summary)
        if rank0.replica_group not in (None, 0):     # torchft: one writer, replica group 0's rank 0
            return summary
        self._ledger(client, rank0, now)
        self._curves(client, rank0, now)
        return summary

    def flush(self, client: EtcdClient) -> None:
        """Write the points not written yet (the round or the run ended)."""
        if self._series is not None and self._series_dirty:
            client.put_json(series_key(client, self.job), self._series)
            self._series_dirty = False

    def _ledger(self, client: EtcdClient, rank0: prog.ProgressRecord, now: float) -> None:
        if self._state is None:
            stored = client.get_json(ledger_key(client, self.job))
            self._state = gl.LedgerState.from_dict(stored.get("state") if isinstance(stored, dict) else None)
        state = self._state
        events = list_events(client, self.job, after=state.seq)     # only those not folded yet
        gen = str(rank0.pid)
        if self._round is None or self._round[0] != gen:
            closed = client.get_json(round_key(client, self.job))
            at = closed.get("at") if isinstance(closed, dict) else None
            self._round = (gen, float(at) if isinstance(at, (int, float)) else None)
        sample = gl.Sample(at=rank0.updated_at, step=rank0.step, phase=rank0.phase, gen=gen, round_at=self._round[1],
                           phase_s=rank0.phase_s)
        gl.fold(state, events, [sample])
        client.put_json(ledger_key(client, self.job), {"state": state.to_dict(), "ledger": gl.close(state, now)})
        for cause, seconds in state.seconds.items():
            self.metrics.set("marind_job_seconds_total", round(seconds, 3), job=self.job, cause=cause)

    def _curves(self, client: EtcdClient, rank0: prog.ProgressRecord, now: float) -> None:
        if self._series is None:
            self._series = job_series.parse(client.get_json(series_key(client, self.job)))
        if rank0.phase in ("training", "checkpointing", "done"):
            self._series, changed = job_series.append(self._series, rank0.updated_at, rank0.step, rank0.loss,
                                                      rank0.tokens_per_s)
            self._series_dirty |= changed
        if self._series_dirty and (now - self._series_written_at >= SERIES_EVERY_S or rank0.phase == "done"):
            client.put_json(series_key(client, self.job), self._series)
            self._series_dirty, self._series_written_at = False, now

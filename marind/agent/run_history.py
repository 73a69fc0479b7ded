"""A run's curves: global rank 0's reports to TensorBoard and W&B, non-finite losses and rollbacks to events.

Where global rank 0 runs, its reporter appends every report to its history file
(``marind.core.history``). Every tick the ``RunProgress`` of the run hands :class:`RunHistory`
a look (``poll``); it reads the new lines and

* writes them as TensorBoard scalars (``loss``, ``tokens_per_s``, each of the program's own
  metrics by name) at the report's step into ``[job] tensorboard_dir`` (default:
  ``{run_dir}/tensorboard``; ``marind tensorboard JOB`` prints it), through
  ``marind.agent.tb_events`` (no TensorFlow, no thread);
* when the spec asks (``[job] wandb = { project = "..." }``), feeds them to a W&B run made by a
  helper process (``python -m marind.agent.wandb_sink``, started once the history file
  appears: W&B's client and its service stay out of the agent), offline when no API key is
  configured (``wandb sync`` uploads it later);
* writes the goodput ledger's parts (``marind.control.goodput_ledger``, as the agent keeps it in
  etcd) as scalars ``goodput/{cause}_s`` and ``goodput/fraction`` every ``LEDGER_EVERY_S``
  and at the run's end;
* finds what the curves say went wrong (:func:`findings`, pure): a loss that became NaN/inf
  (a ``nonfinite_loss`` event, and the job's ``last_error``) and a step that went back within
  one worker generation (a ``rollback`` event naming the non-finite step that caused it).

A failure to write the curves is logged once and the curves are dropped; it never stops the run.
A full disk (ENOSPC, EDQUOT) only pauses them: the event file is dropped, and every
``TB_RETRY_S`` a new one is tried; the first that can be written resumes the curves from the
next report (the reports meanwhile are not written: a gap, no back-fill).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marind.agent.outbox import Outbox
from marind.control.failure_causes import nonfinite_cause
from marind.control.job_history import ledger_key
from marind.core.disk import is_disk_full
from marind.core.errors import ControlPlaneUnavailable
from marind.core.history import HistoryTail, history_path
from marind.core.spec import RunSpec, tensorboard_dir

#: How often the goodput ledger's parts are written as scalars (and once more at the run's end).
LEDGER_EVERY_S = 10.0
#: How often a new event file is tried while the disk is full.
TB_RETRY_S = 10.0


@dataclass
class Watch:
    """What :func:`findings` remembers between lines."""

    pid: int | None = None
    top: int | None = None               # the highest step this worker generation reported
    nonfinite_at: int | None = None      # the step of the last non-finite loss not yet rolled back
    in_streak: bool = False              # the previous line's loss was non-finite


@dataclass
class Finding:
    """An event the history calls for: ``kind`` (``nonfinite_loss`` or ``rollback``) and its detail."""

    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


def findings(watch: Watch, line: dict[str, Any]) -> list[Finding]:
    """What one history line says went wrong (updates ``watch``).

    * the first non-finite loss of a streak: ``nonfinite_loss`` ``{step, value}``;
    * a step lower than this worker generation's highest (same pid): ``rollback``
      ``{from_step, to_step, cause}``, the cause naming the non-finite loss before it if any.
      A new generation (another pid) starting lower is a restart's restore, not a rollback.

    Args:
        watch: the state kept between lines.
        line: one history line.

    Returns:
        The findings, in order.
    """
    out = []
    step, pid = int(line["step"]), line.get("pid")
    if pid != watch.pid:
        watch.pid, watch.top, watch.in_streak = pid, None, False
    if watch.top is not None and step < watch.top:
        cause = (f"non-finite loss at step {watch.nonfinite_at}" if watch.nonfinite_at is not None
                 else "the program went back to an earlier step")
        out.append(Finding("rollback", {"from_step": watch.top, "to_step": step, "cause": cause}))
        watch.nonfinite_at, watch.top = None, step
    value = line.get("loss_nonfinite")
    if value is not None:
        if not watch.in_streak:
            out.append(Finding("nonfinite_loss", {"step": step, "value": str(value)}))
            watch.nonfinite_at = step
        watch.in_streak = True
    else:
        watch.in_streak = False
    watch.top = step if watch.top is None else max(watch.top, step)
    return out


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard/W&B scalars of one history line: ``loss``, ``tokens_per_s``, the program's metrics."""
    out = {}
    for key in ("loss", "tokens_per_s"):
        if isinstance(line.get(key), (int, float)):
            out[key] = float(line[key])
    metrics = line.get("metrics")
    if isinstance(metrics, dict):
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in out:
                out[str(name)] = float(value)
    return out


class RunHistory:
    """One run's history on this node: curves out, findings to events.

    Args:
        job: the job's id.
        spec: its spec (``[job] tensorboard_dir``, ``[job] wandb``).
        run_dir: its run dir on this node.
        node: this node's name.
        outbox: where findings go.
        log: the run's logger.
    """

    def __init__(self, job: str, spec: RunSpec, run_dir: Path, *, node: str, outbox: Outbox, log: Any):
        self.job, self.spec, self.run_dir, self.node, self.outbox, self.log = job, spec, run_dir, node, outbox, log
        self.tail = HistoryTail(history_path(run_dir))
        self.tb_dir = Path(tensorboard_dir(spec, run_dir))
        self._tb: Any = None
        self._tb_off = False
        self._tb_paused_at: float | None = None    # the curves' disk was full then (monotonic)
        self._watch = Watch()
        self._wandb: subprocess.Popen | None = None
        self._wandb_tried = False
        self._ledger_at = 0.0
        self._last_step: int | None = None

    def poll(self) -> int:
        """Read the new history lines; write the curves; record the findings.

        Returns:
            The lines read.
        """
        try:
            lines = self.tail.read()
        except OSError as exc:          # the file went away between two looks: next tick
            self.log.debug("history_unreadable", error=str(exc))
            return 0
        if not lines:
            return 0
        self._start_wandb()
        for line in lines:
            for f in findings(self._watch, line):
                self._record(f)
            self._write_tb(line)
        self._last_step = int(lines[-1]["step"])
        self._write_ledger(force=False)
        if self._tb is not None:
            try:
                self._tb.flush()
            except OSError as exc:
                self._tb_failed(exc)
        return len(lines)

    def close(self) -> None:
        """The run ended: the last lines, the event file closed, the W&B run finished (its helper
        reads the rest and ends within ``wandb_wait`` seconds, else it is killed)."""
        self.poll()
        if self._tb is not None:
            self._write_ledger(force=True)
        tb, self._tb = self._tb, None
        if tb is not None:
            try:
                tb.close()
            except OSError as exc:
                self.log.warning("tensorboard_close_failed", dir=str(self.tb_dir), error=str(exc))
        proc, self._wandb = self._wandb, None
        if proc is not None and proc.poll() is None:
            proc.terminate()            # the helper reads what is left, then finishes the run
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def _record(self, f: Finding) -> None:
        self.log.warning(f.kind, **f.detail)
        self.outbox.event(self.job, f.kind, dict(f.detail))
        if f.kind == "nonfinite_loss":
            cause = nonfinite_cause(f.detail["step"], f.detail["value"], self.node)
            self.outbox.last_error(self.job, {"line": cause.line, "node": self.node, "at": time.time(),
                                              "source": "history", "step": f.detail["step"], **cause.to_dict()})

    def _write_tb(self, line: dict[str, Any]) -> None:
        if self._tb_off:
            return
        if self._tb is None:
            paused = self._tb_paused_at
            if paused is not None and time.monotonic() - paused < TB_RETRY_S:
                return
            try:
                from marind.agent.tb_events import EventWriter
                self._tb = EventWriter(self.tb_dir)
            except (ImportError, OSError) as exc:
                if isinstance(exc, OSError) and is_disk_full(exc):
                    self._tb_failed(exc)
                    return
                self._tb_off = True
                self.log.warning("tensorboard_off", dir=str(self.tb_dir), error=str(exc),
                                 hint="pip install tensorboard; check that the directory is writable")
                return
            if paused is not None:
                self._tb_paused_at = None
                self.log.info("tensorboard_resumed", dir=str(self.tb_dir), file=str(self._tb.path))
        try:
            for name, value in scalars(line).items():
                self._tb.scalar(name, value, int(line["step"]), float(line.get("at") or 0.0))
        except OSError as exc:
            self._tb_failed(exc)

    def _tb_failed(self, exc: OSError) -> None:
        """A write of the curves failed: a full disk pauses them (a new file later), anything else ends them."""
        tb, self._tb = self._tb, None
        if tb is not None:
            try:
                tb.close()
            except OSError:
                pass
        if not is_disk_full(exc):
            self._tb_off = True
            self.log.warning("tensorboard_off", dir=str(self.tb_dir), error=str(exc))
            return
        if self._tb_paused_at is None:
            self.log.warning("tensorboard_paused", dir=str(self.tb_dir), error=str(exc),
                             action=f"a new event file is tried every {TB_RETRY_S:g}s")
        self._tb_paused_at = time.monotonic()

    def _write_ledger(self, *, force: bool) -> None:
        """The goodput ledger's parts (``{p}/jobs/{job}/ledger``, kept by this node's agent where rank 0
        runs) as scalars at the last step: ``goodput/{cause}_s`` and ``goodput/fraction``."""
        now = time.time()
        client = getattr(self.outbox, "client", None)
        if self._tb is None or self._last_step is None or client is None or (
                not force and now - self._ledger_at < LEDGER_EVERY_S):
            return
        self._ledger_at = now
        try:
            doc = client.get_json(ledger_key(client, self.job))
        except ControlPlaneUnavailable:
            return                       # the next look, or the run's end
        ledger = doc.get("ledger") if isinstance(doc, dict) else None
        if not isinstance(ledger, dict) or not isinstance(ledger.get("seconds"), dict):
            return
        parts = {f"goodput/{cause}_s": v for cause, v in ledger["seconds"].items() if isinstance(v, (int, float))}
        if isinstance(ledger.get("goodput"), (int, float)):
            parts["goodput/fraction"] = ledger["goodput"]
        try:
            for tag, value in parts.items():
                self._tb.scalar(tag, float(value), self._last_step, now)
        except OSError as exc:
            if is_disk_full(exc):
                self._tb_failed(exc)
            else:
                self.log.warning("tensorboard_ledger_failed", error=str(exc))

    def _start_wandb(self) -> None:
        table = dict(self.spec.job.wandb)
        if not table or self._wandb_tried:
            return
        self._wandb_tried = True
        cmd = [sys.executable, "-m", "marind.agent.wandb_sink", "--history", str(self.tail.path),
               "--dir", str(self.run_dir), "--job", self.job]
        for key, value in sorted(table.items()):
            cmd += [f"--{key}", value]
        try:
            out = open(self.run_dir / "logs" / "wandb.log", "ab")
        except OSError as exc:             # a full disk among others: no W&B run, the run goes on
            self.log.warning("wandb_off", error=str(exc))
            return
        try:
            self._wandb = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        except OSError as exc:
            self.log.warning("wandb_off", error=str(exc))
            self._wandb = None
        finally:
            out.close()
        self.log.info("wandb_started", pid=self._wandb and self._wandb.pid, project=table.get("project"))

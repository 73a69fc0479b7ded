"""``report()``: a worker rank's progress, for its agent's hang detection, ``status`` and metrics.

Each call rewrites this rank's progress record (``marind.core.progress``: one record type for
the reference trainer and any program) with the step, the loss, tokens per second and the
program's own metrics. The agent counts a rank whose step stops moving for ``[job]
hang_timeout`` as hung (stack dump, restart), so a program that reports once per optimizer
step gets hang detection for free. Outside marind (no ``MARIND_RUN_DIR``) a report is a
cheap no-op.

Tokens per second: ``tokens`` is what the whole job (all ranks together) processed since
the previous report; the rate divides it by the time since the previous report (or since
:meth:`Reporter.mark`, or since the reporter was made, for the first one).
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from marind.core import workerenv as WE
from marind.core.history import HistoryWriter, history_line, history_path
from marind.core.progress import ProgressRecord, ProgressWriter


def tokens_per_s(tokens: float | None, seconds: float) -> float | None:
    """The rate of a report: ``tokens`` over ``seconds``; None without tokens or a positive time.

    Args:
        tokens: tokens processed since the previous report (None: not reported).
        seconds: time since the previous report.

    Returns:
        Tokens per second, or None.
    """
    if tokens is None or seconds <= 0:
        return None
    return float(tokens) / seconds


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A report's extra metrics as numbers (a 0-dim tensor or numpy scalar converts).

    Args:
        metrics: name -> value, as given to :func:`report`.

    Returns:
        name -> float.

    Raises:
        TypeError: a value is not a number (names it).
    """
    out = {}
    for name, value in metrics.items():
        if isinstance(value, (bool, str)) or value is None:
            raise TypeError(f"report({name}={value!r}): metrics must be numbers")
        try:
            out[name] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"report({name}=...): metrics must be numbers, got {type(value).__name__}") from exc
    return out


class Reporter(ProgressWriter):
    """One rank's progress record with the rate and metrics bookkeeping of :func:`report`.

    Args:
        rank: global rank.
        local_rank: rank on this node.
        world_size: size of the torch world.
        run_dir: the run directory; None keeps the record in memory only (no file).
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, rank: int, local_rank: int, world_size: int, run_dir: str | Path | None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(rank, local_rank, world_size, run_dir)
        self._clock = clock
        self._mark = clock()
        # global rank 0 keeps every report too: the agent's curves (marind.core.history)
        self._history = HistoryWriter(history_path(run_dir)) if run_dir and rank == 0 else None

    def mark(self) -> None:
        """Start the rate's clock now (e.g. after a restore, so it is not counted as training time)."""
        self._mark = self._clock()

    def report(self, step: int, loss: float | torch.Tensor | None = None, tokens: float | None = None,
               metrics: Mapping[str, Any] | None = None, **fields: Any) -> ProgressRecord:
        """Record ``step`` (phase ``training``) and rewrite the file.

        Args:
            step: optimizer steps completed.
            loss: the step's loss (a 0-dim tensor converts; NaN is kept as None, and in rank 0's history
                as non-finite: ``marind.core.history``).
            tokens: tokens the whole job processed since the previous report.
            metrics: extra numbers (the record's ``metrics``; None leaves the last ones).
            fields: other record fields (``last_checkpoint_step``, the trainer's torchft fields).

        Returns:
            The record as written.

        Raises:
            TypeError: a metric is not a number.
            OSError: the file could not be written (not for a full disk: the record waits for the
                next report, and rank 0's history line is dropped).
        """
        now = self._clock()
        rate = tokens_per_s(tokens, now - self._mark)
        self._mark = now
        raw = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        value = raw if raw is not None and math.isfinite(raw) else None
        if metrics is not None:
            fields["metrics"] = check_metrics(metrics)
        fields.setdefault("phase", "training")
        self.update(step=int(step), loss=value, tokens_per_s=rate, **fields)
        if self._history is not None:
            self._history.append(history_line(step, loss=raw, tokens_per_s=rate, at=self.record.updated_at,
                                              metrics=fields.get("metrics"), pid=self.record.pid))
        return self.record


_lock = threading.Lock()
_default: Reporter | None = None
_default_pid = 0
_off = False   # no MARIND_RUN_DIR: report() is a no-op


def _rank_env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} = {value!r} must be an integer (set by torchrun)") from None


def default_reporter() -> Reporter | None:
    """This process's reporter, made on first use from the environment; None outside marind.

    Rank, local rank and world size come from torchrun's ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE``; the file from ``MARIND_RUN_DIR``. A forked child gets its own.

    Raises:
        ValueError: one of those variables is not an integer.
    """
    global _default, _default_pid, _off
    pid = os.getpid()
    if _default_pid == pid and (_off or _default is not None):
        return _default
    with _lock:
        run_dir = os.environ.get(WE.RUN_DIR)
        _default_pid = pid
        _off = not run_dir
        _default = None if _off else Reporter(_rank_env("RANK", 0), _rank_env("LOCAL_RANK", 0),
                                               _rank_env("WORLD_SIZE", 1), run_dir)
        if _default is not None:
            atexit.register(_finish_at_exit, _default)
        return _default


def _finish_at_exit(reporter: Reporter) -> None:
    """A clean interpreter exit ends the record in phase ``done`` (if :func:`finish` did not)."""
    if reporter.record.phase != "done" and reporter.record.pid == os.getpid():
        try:
            reporter.update(phase="done")
        except OSError:
            pass   # the run dir went away: nobody is watching any more


def report(step: int, loss: float | torch.Tensor | None = None, tokens: float | None = None, **metrics: Any) -> None:
    """Report this rank's progress after an optimizer step (call it on every rank, every step).

    Args:
        step: optimizer steps completed so far (the step a checkpoint now would hold).
        loss: the step's loss (float or 0-dim tensor; optional).
        tokens: tokens the whole job (all ranks) processed since the previous report
            (optional; gives ``tokens_per_s``).
        metrics: the program's own numbers (``lr=3e-4, grad_norm=0.8``), shown by
            ``marind status --json`` and the agent's metrics.

    Raises:
        TypeError: a metric is not a number.
        OSError: the record could not be written (a full disk is not an error: it is written at the next
            report that fits).
    """
    reporter = default_reporter()
    if reporter is None:
        return
    reporter.report(step, loss, tokens, metrics or None)


def set_phase(phase: str, **fields: Any) -> None:
    """Set this rank's phase (``marind.core.progress.PHASES``) without a step; no-op outside marind.

    Args:
        phase: e.g. ``"checkpointing"`` while a save runs, ``"done"`` at the end.
        fields: other record fields (``last_checkpoint_step``).

    Raises:
        ValueError: an unknown phase.
    """
    reporter = default_reporter()
    if reporter is not None:
        reporter.update(phase=phase, **fields)


def finish() -> None:
    """Mark this rank done (phase ``done``): training is over, the agent stops watching it for hangs.

    Call it after the training loop, before slow work that reports no steps (evaluation,
    export, teardown), which hang detection would otherwise take for a hang. A clean exit
    does it too, but only at the very end. A no-op outside marind.

    Raises:
        OSError: the record could not be written.
    """
    set_phase("done")

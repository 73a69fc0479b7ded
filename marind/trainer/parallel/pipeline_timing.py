"""The pipeline's bubble, measured: per rank, time computing in its stages versus the schedule's wall time.

Opt-in (a benchmark's): with ``MARIND_BENCH_PP_TIMING=N`` set, :class:`StageTimer` wraps the
rank's ``PipelineStage`` objects' ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` and the schedule's loss computation (``_maybe_compute_loss``, where
the schedule has it), and ``marind.trainer.parallel.pipeline.Pipeline`` brackets each schedule run with
:meth:`StageTimer.begin` / :meth:`StageTimer.end`. Steps 1..N are warm-up and not counted (the first
schedule run also infers the stages' shapes). Unset, nothing is wrapped: no cost on the step path.

* **busy**: wall time inside those calls: the stage's forward (and the last stage's loss) and
  backward, including the collectives inside the stage (FSDP, expert all-to-all), excluding the
  waits for the neighbouring stages' activations and gradients;
* **wall**: wall time of the schedule runs (``schedule.step``);
* **bubble** = ``1 - busy / wall``: the share of the schedule run the rank was idle.

On CUDA every bracket synchronizes the device first and last, so kernels are counted where they
run (this slows the run a little: it is a measurement mode). The rank's totals go into its final
progress record's ``metrics`` (``pp_busy_s``, ``pp_wall_s``, ``pp_bubble``, ``pp_timed_steps``).

:func:`schedule_bubble` is the schedule's own figure for comparison: ``(pp - 1) / (v m + pp - 1)``
for ``m`` micro-batches and ``v`` stages per rank (``v = 1``: 1F1B, GPipe).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from marind.core import workerenv

#: what :class:`StageTimer` wraps on each stage
STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
#: what it wraps on the schedule (the last stage's loss; absent on other torch versions: not wrapped)
SCHEDULE_METHODS = ("_maybe_compute_loss",)


def measured_bubble(busy_s: float, wall_s: float) -> float:
    """The idle share of a rank's schedule runs: ``1 - busy / wall``, within [0, 1] (pure).

    Args:
        busy_s: seconds computing in the rank's stages.
        wall_s: seconds of the schedule runs.

    Returns:
        The bubble fraction (clock jitter that puts busy above wall gives 0).

    Raises:
        ValueError: ``wall_s`` is not positive or ``busy_s`` is negative.
    """
    if wall_s <= 0 or busy_s < 0:
        raise ValueError(f"busy {busy_s} s of wall {wall_s} s: the wall time must be > 0 and busy >= 0")
    return min(1.0, max(0.0, 1.0 - busy_s / wall_s))


def schedule_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The schedule's idle share: ``(pp - 1) / (stages_per_rank * microbatches + pp - 1)`` (pure).

    Args:
        pp: pipeline ranks.
        microbatches: micro-batches per schedule run.
        stages_per_rank: virtual stages per rank (2+ for Interleaved1F1B, else 1).

    Returns:
        The fraction; 0 for ``pp = 1``.

    Raises:
        ValueError: a count below 1.
    """
    if min(pp, microbatches, stages_per_rank) < 1:
        raise ValueError(f"pp = {pp}, microbatches = {microbatches}, stages_per_rank = {stages_per_rank}: "
                         "each must be >= 1")
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def bubble_of_ranks(metrics: Iterable[Mapping[str, float]]) -> dict[str, Any]:
    """The measured bubble of every rank and their mean, from the ranks' record metrics (pure).

    Args:
        metrics: each rank's final ``metrics``, in rank order.

    Returns:
        ``{"per_rank": [...], "mean": m}``, or ``{}`` when a rank timed no step (timing was off).
    """
    values = []
    for m in metrics:
        if not m.get("pp_timed_steps") or m.get("pp_wall_s", 0.0) <= 0:
            return {}
        values.append(round(measured_bubble(m["pp_busy_s"], m["pp_wall_s"]), 4))
    if not values:
        return {}
    return {"per_rank": values, "mean": round(sum(values) / len(values), 4)}


def timing_skip(environ: Mapping[str, str]) -> int | None:
    """``MARIND_BENCH_PP_TIMING``: warm-up steps not timed, or None when unset (off).

    Raises:
        ValueError: the value is not an integer >= 0.
    """
    value = environ.get(workerenv.BENCH_PP_TIMING, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{workerenv.BENCH_PP_TIMING} = {value!r} must be an integer >= 0 (warm-up steps not "
                         "timed); unset it to turn the timing off")
    return int(value)


class StageTimer:
    """Busy and wall seconds of a rank's pipeline schedule runs (see the module docstring).

    Args:
        skip_steps: steps 1..skip_steps are not timed.
        device: the rank's device (CUDA: synchronized around each bracket).
        clock: seconds (injected in tests).
    """

    def __init__(self, *, skip_steps: int, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.skip_steps = skip_steps
        self.device = device
        self.clock = clock
        self.busy_s = 0.0
        self.wall_s = 0.0
        self.timed_steps: set[int] = set()
        self._step = 0
        self._on = False
        self._depth = 0
        self._t0 = 0.0

    @classmethod
    def from_environ(cls, stages: Iterable[Any], schedule: Any, device: torch.device,
                     environ: Mapping[str, str] | None = None) -> StageTimer | None:
        """A timer wrapped around ``stages`` and ``schedule`` when ``MARIND_BENCH_PP_TIMING`` is set, else None.

        Raises:
            ValueError: the variable is malformed.
        """
        skip = timing_skip(os.environ if environ is None else environ)
        if skip is None:
            return None
        timer = cls(skip_steps=skip, device=device)
        for stage in stages:
            timer.wrap(stage, STAGE_METHODS)
        timer.wrap(schedule, SCHEDULE_METHODS)
        return timer

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, obj: Any, names: Iterable[str]) -> None:
        """Replace ``obj``'s methods ``names`` (those it has) by timed ones, on the instance."""
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self._timed(fn))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._on or self._depth:
                return fn(*args, **kwargs)
            self._sync()
            self._depth += 1
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.busy_s += self.clock() - t0
                self._depth -= 1
        return timed

    def begin(self, step_index: int) -> None:
        """A schedule run of the step after ``step_index`` completed steps starts."""
        self._step = step_index + 1
        self._on = self._step > self.skip_steps
        if self._on:
            self._sync()
            self._t0 = self.clock()

    def end(self) -> None:
        """The schedule run started by :meth:`begin` is over."""
        if self._on:
            self._sync()
            self.wall_s += self.clock() - self._t0
            self.timed_steps.add(self._step)
            self._on = False

    def metrics(self) -> dict[str, float]:
        """``pp_busy_s``, ``pp_wall_s``, ``pp_bubble``, ``pp_timed_steps``; {} before any timed step."""
        if not self.timed_steps or self.wall_s <= 0:
            return {}
        return {"pp_busy_s": round(self.busy_s, 6), "pp_wall_s": round(self.wall_s, 6),
                "pp_bubble": round(measured_bubble(self.busy_s, self.wall_s), 6),
                "pp_timed_steps": float(len(self.timed_steps))}

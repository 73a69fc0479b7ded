"""The one training loop, shared by the elastic mode (``train.py``) and the torchft mode (``ft/train.py``).

What differs between modes sits behind :class:`TrainMode`, whose hooks :func:`run_loop`
calls in this order (a hook's name in brackets)::

    [start]              restore (elastic) or join the replica groups (torchft), log train_start
    loop:
      [next_step]        which step runs now (state.step); False ends the loop
                         (elastic: step < train.steps; torchft: quorum, heal or restore first)
      lr                 lr_at(step) into every param group
      forward/backward   run.accum micro-batches, [sample_indices] picks each one's samples
      [on_gradients]     local gradients complete (torchft: averaged across replica groups)
      clip               global grad norm, clipped to optim.grad_clip
      [commit]           apply this step? then optimizer.step() if so, and zero_grad
                         (set_to_none = mode.grads_to_none)
      [advance]          step counter and data position after the step
      all-reduce         mean loss, stop request, time-based checkpoint due, checkpoint commits held
                         on some rank (within the torch world)
      [report_step]      the step's log line (rank 0)
      [after_step]       elastic: roll back after train.max_bad_steps non-finite steps
      progress record    step, loss, tokens/s, last checkpoint, compute_s (forward/backward and
                         optimizer step, collectives left out: compute_time), [progress_fields]
      stop               when any rank was asked to (SIGTERM/SIGINT through marind.worker.stop's
                         handler, MARIND_TEST_STOP_AT_STEP), agreed in the all-reduce above
      [save_due]         periodic checkpoint of (state.step, state.position)
    [after_loop]         settle the final step (torchft: the Manager's)
    [final_save_due]     final checkpoint; after a stop [save_on_stop] (a failure is logged)
    [finish]             wait for saves, release resources; then the last log line and record

Extending it: a concern every mode shares belongs in :func:`run_loop`, one only some modes
have in a hook (with a no-op default on :class:`TrainMode`). Model parallelism: pipeline
parallelism (``run.pipeline``, elastic mode) replaces :func:`_forward_backward` (a schedule runs
the micro-batches across stages, only the last stage has a loss, so the mean loss divides by the
ranks of one stage; ``marind.trainer.parallel.pipeline``) and clipping sums over the stages; expert
parallelism adds its gradient reduction next to ``on_gradients`` and its auxiliary loss to the loss.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckpt_store import CheckpointError
from marind.trainer.build import Run
from marind.trainer.compute_time import ComputeTimer
from marind.trainer.config import TrainerSpec
from marind.trainer.model.gpt import lm_loss
from marind.trainer.model.moe import router_summary, take_moe_outputs
from marind.trainer.parallel.mesh import clip_grad_norm
from marind.trainer.schedule import lr_at
from marind.worker.stop import StopFlag

STOP_EXIT_CODE = 143  # stopped by SIGTERM/SIGINT after a clean shutdown

__all__ = ["STOP_EXIT_CODE", "Finish", "LoopState", "Result", "StepReport", "StopFlag", "TrainMode", "log_due",
           "run_loop", "stop_here"]


@dataclass
class Result:
    """How a run ended, as ``train`` and ``train_ft`` return it."""

    step: int
    data_position: int
    loss: float | None
    losses: list[float]
    skipped_steps: list[int]
    rollbacks: int
    stopped: bool
    last_checkpoint_step: int | None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-able)."""
        return dict(self.__dict__)


@dataclass
class LoopState:
    """What changes from step to step; the loop and its mode both update it.

    Attributes:
        step: optimizer steps completed (after ``next_step``: the index of the step about to run).
        position: the data position (global samples consumed) that a checkpoint of ``step`` holds.
        loss: mean loss of the last step.
        losses: the loss of every committed step.
        skipped_steps: the numbers of steps that were not committed.
        rollbacks: rollbacks to the latest checkpoint (elastic mode).
        stopped: a stop was requested (no final checkpoint).
        t_mark: ``time.perf_counter()`` at which the current step's time started.
        save_s: seconds the saves since the last step blocked (part of the next step's time).
    """

    step: int = 0
    position: int = 0
    loss: float | None = None
    losses: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    rollbacks: int = 0
    stopped: bool = False
    t_mark: float = 0.0
    save_s: float = 0.0


@dataclass(frozen=True)
class StepReport:
    """One finished step, for ``TrainMode.report_step``."""

    step: int
    loss: float
    grad_norm: torch.Tensor
    lr: float
    tokens_per_s: float
    step_s: float
    committed: bool
    save_s: float = 0.0     # of step_s, the time a save before the step blocked training
    router: dict[str, Any] = field(default_factory=dict)   # MoE router statistics (moe.router_summary)


@dataclass(frozen=True)
class Finish:
    """Extra fields of the run's last log line and last progress record."""

    log_fields: dict[str, Any] = field(default_factory=dict)
    record_fields: dict[str, Any] = field(default_factory=dict)


def log_due(step: int, spec: TrainerSpec) -> bool:
    """Whether ``step`` gets a ``step`` log line: every ``train.log_every`` steps and the last one."""
    return step % spec.train.log_every == 0 or step == spec.train.steps


def save_field(report: StepReport) -> dict[str, float]:
    """The ``step`` line's ``save_s`` (of its ``step_s``, the seconds a save before the step blocked
    training), where a save did; else nothing."""
    return {"save_s": round(report.save_s, 4)} if report.save_s > 0 else {}


class TrainMode(ABC):
    """The seam between :func:`run_loop` and a training mode; see the module docstring for the order.

    Attributes:
        grads_to_none: ``zero_grad(set_to_none=...)`` after each step (torchft keeps the
            gradient tensors: its cross-group all-reduce needs every one).
        announce_saves: rank 0 logs ``durable_checkpoint`` before each save.
    """

    grads_to_none: bool = True
    announce_saves: bool = False

    def log_context(self) -> dict[str, Any]:
        """Fields bound to every log line of the run (besides ``rank`` and ``job``)."""
        return {}

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called on the fresh model and optimizer, before the checkpointer exists."""
        return None  # optional hook

    @abstractmethod
    def start(self, run: Run, state: LoopState) -> None:
        """Before the first step: restore or join, log ``train_start``, set ``state``."""

    @abstractmethod
    def next_step(self, run: Run, state: LoopState) -> bool:
        """Set ``state.step`` (and position) to the step about to run; False ends the loop."""

    @abstractmethod
    def sample_indices(self, run: Run, state: LoopState, micro_step: int) -> Sequence[int]:
        """Global sample indices of this rank's micro-batch ``micro_step`` of the current step."""

    def on_gradients(self, run: Run, state: LoopState) -> None:
        """The local gradients of the step are complete (before clipping)."""
        return None  # optional hook

    @abstractmethod
    def commit(self, run: Run, state: LoopState, grad_norm: torch.Tensor) -> bool:
        """Whether the optimizer applies this step (``grad_norm``: before clipping)."""

    @abstractmethod
    def advance(self, run: Run, state: LoopState, committed: bool) -> None:
        """Move ``state.step`` and ``state.position`` past the step just run."""

    @abstractmethod
    def report_step(self, run: Run, state: LoopState, report: StepReport) -> None:
        """Log (and record metrics of) the step just run."""

    def after_step(self, run: Run, state: LoopState) -> None:
        """After the step's report, before its progress record."""
        return None  # optional hook

    def progress_fields(self) -> dict[str, Any]:
        """Extra fields of each step's progress record."""
        return {}

    @abstractmethod
    def save_due(self, run: Run, state: LoopState, committed: bool, time_due: bool) -> bool:
        """Whether to checkpoint ``state.step`` now (``time_due``: checkpoint.every_seconds passed)."""

    def after_loop(self, run: Run, state: LoopState) -> None:
        """The loop ended (done or stopped): settle ``state``."""
        return None  # optional hook

    @abstractmethod
    def final_save_due(self, run: Run, state: LoopState) -> bool:
        """Whether to write a final checkpoint (asked only when the run was not stopped)."""

    def save_on_stop(self, run: Run, state: LoopState) -> bool:
        """Whether a stopped run saves the step it reached before its workers exit (default: no)."""
        return False

    @abstractmethod
    def finish(self, run: Run, state: LoopState) -> Finish:
        """Wait for checkpoints in flight, release resources; the last line's and record's extra fields."""


def _batches(run: Run, mode: TrainMode, state: LoopState) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Draws this rank's micro-batch ``k`` of the current step (the mode picks its samples)."""
    return lambda k: run.sampler.batch(mode.sample_indices(run, state, k), run.device)


def _forward_backward(run: Run, mode: TrainMode, state: LoopState) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of the step's micro-batches; returns this rank's loss (a tensor, the
    language-model loss only) and the MoE router statistics summed over the micro-batches (flattened;
    empty for a dense model). A MoE model's auxiliary losses are added to the loss it backpropagates."""
    loss_acc = torch.zeros((), device=run.device)
    router = torch.zeros(0, device=run.device, dtype=torch.float64)
    batch = _batches(run, mode, state)
    for k in range(run.accum):
        x, y = batch(k)
        loss = lm_loss(run.model(x), y) / run.accum
        moe = take_moe_outputs(run.model)
        if moe is not None:
            (loss + moe.aux_loss / run.accum).backward()
            take_moe_outputs(run.model)   # drop what an activation-checkpoint recompute left (its graph)
            router = moe.stats.flatten() if router.numel() == 0 else router + moe.stats.flatten()
        else:
            loss.backward()
        loss_acc += loss.detach()
    return loss_acc, router


def _router(run: Run, stats: torch.Tensor) -> dict[str, Any]:
    """The step's router fields (``moe.router_summary``) from the all-reduced statistics; {} when dense."""
    if stats.numel() == 0:
        return {}
    return router_summary(stats.reshape(-1, run.cfg.n_experts + 3).cpu(), replicas=run.layout.tp,
                          samples=run.world // run.layout.pp * run.accum)   # a layer's ranks: one stage's


def _save(run: Run, mode: TrainMode, state: LoopState, *, wait: bool = False) -> None:
    run.progress.update(phase="checkpointing")
    if mode.announce_saves and run.rank == 0:
        run.log.info("durable_checkpoint", step=state.step)
    run.ckpt.save(state.step, state.position, wait=wait)


def _save_at_stop(run: Run, mode: TrainMode, state: LoopState) -> None:
    """A stopped run's save of the step it reached (every rank stopped at the same step): the job resumes
    there, losing no step to a cancel, a resize or a drain. A failure is logged; the stop goes on."""
    try:
        _save(run, mode, state, wait=True)
    except (CheckpointError, TimeoutError) as exc:
        run.log.error("checkpoint_at_stop_failed", step=state.step, error=str(exc))


def stop_here(requested: bool, step: int, stop_at: int) -> bool:
    """Whether this rank asks to stop after the step just taken.

    Args:
        requested: a SIGTERM (or the agent's stop) arrived.
        step: the step counter after this step (unchanged by a step torchft did not commit).
        stop_at: the test hook ``MARIND_TEST_STOP_AT_STEP``; 0 means off, so a torchft run
            whose first step is not committed (step still 0) keeps going.
    """
    return requested or (stop_at > 0 and step == stop_at)


def run_loop(run: Run, mode: TrainMode, stop: StopFlag) -> Result:
    """Train ``run`` in ``mode`` to ``train.steps`` or a stop.

    Args:
        run: the built run (``marind.trainer.build.setup_run``).
        mode: the training mode.
        stop: the stop flag; every rank stops after the step in which any rank saw it set.

    Returns:
        How the run ended.

    Raises:
        Whatever the mode's hooks raise (e.g. ``TrainingDiverged``); a failed final
        checkpoint raises ``ckpt_store.CheckpointSaveFailed``.
    """
    spec, ckpt = run.spec, run.ckpt
    d, o, t = spec.data, spec.optim, spec.train
    tokens_per_step = d.global_batch * d.seq_len
    stop_at = run.env.test_stop_at_step
    state = LoopState()
    timer = ComputeTimer(run.device)
    mode.start(run, state)
    state.t_mark = time.perf_counter()  # step time runs end to end, so checkpoint stalls count
    run.progress.mark()                 # the same for the record's tokens/s (marind.worker.reporting)
    while mode.next_step(run, state):
        attempted = state.step + 1
        lr = lr_at(state.step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=t.steps)
        for g in run.optimizer.param_groups:
            g["lr"] = lr
        pipe = run.pipeline   # pipeline parallelism: the schedule runs the micro-batches (marind.trainer.parallel.pipeline)
        with timer:
            loss_acc, router = pipe.forward_backward(_batches(run, mode, state), state.step) if pipe \
                else _forward_backward(run, mode, state)
        mode.on_gradients(run, state)
        norm = clip_grad_norm(run.params, o.grad_clip, pp_mesh=pipe.norm_meshes if pipe else None)
        committed = mode.commit(run, state, norm)
        if committed:
            with timer:
                run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=mode.grads_to_none)
        mode.advance(run, state, committed)
        flags = torch.stack([loss_acc.float(),
                             torch.tensor(float(stop_here(stop.requested, state.step, stop_at)), device=run.device),
                             torch.tensor(float(run.rank == 0 and ckpt.time_due()), device=run.device),
                             torch.tensor(float(ckpt.held_here(state.step)), device=run.device)])
        if router.numel():   # MoE: the router statistics ride on the same all-reduce
            flags = torch.cat([flags.double(), router])
        dist.all_reduce(flags)
        ckpt.agree_held(state.step, float(flags[3]) > 0)
        state.loss = loss = float(flags[0]) / (run.world // run.layout.pp)   # the ranks that have a loss
        now = time.perf_counter()
        dt, state.t_mark = now - state.t_mark, now
        tps = tokens_per_step / dt
        if committed:
            state.losses.append(loss)
        else:
            state.skipped_steps.append(attempted)
        mode.report_step(run, state, StepReport(step=state.step, loss=loss, grad_norm=norm, lr=lr,
                                                tokens_per_s=tps, step_s=dt, committed=committed,
                                                save_s=state.save_s, router=_router(run, flags[4:])))
        state.save_s = 0.0
        mode.after_step(run, state)
        run.progress.report(state.step, loss, tokens=tokens_per_step, last_checkpoint_step=ckpt.poll(),
                            compute_s=timer.take(), **mode.progress_fields())
        if float(flags[1]) > 0:
            state.stopped = True
            break
        if state.step < t.steps and mode.save_due(run, state, committed, time_due=float(flags[2]) > 0):
            began = time.perf_counter()
            _save(run, mode, state)
            run.progress.update(phase="training", last_checkpoint_step=ckpt.last_step)
            state.save_s += time.perf_counter() - began

    mode.after_loop(run, state)
    if state.stopped:
        if mode.save_on_stop(run, state):
            _save_at_stop(run, mode, state)
    elif mode.final_save_due(run, state):
        _save(run, mode, state, wait=True)
    end = mode.finish(run, state)
    if run.rank == 0:
        run.log.info("stopping" if state.stopped else "train_done", step=state.step, loss=state.loss,
                     **end.log_fields)
    run.progress.update(phase="done", step=state.step, last_checkpoint_step=ckpt.last_step, **end.record_fields)
    return Result(state.step, state.position, state.loss, state.losses, state.skipped_steps, state.rollbacks,
                  state.stopped, ckpt.last_step)

"""Elastic mode, the default: one torch world (resized by torchrun restarts), restored from checkpoints.

:func:`train` runs ``marind.trainer.loop.run_loop`` with :class:`ElasticMode`: the step count
and the data position are the run's own, restored from the latest checkpoint at start;
every step is all-reduced over the whole world (FSDP2/TP, ``marind.trainer.parallel.mesh``).

Test hooks: ``MARIND_TEST_STOP_AT_STEP=N`` acts as a SIGTERM arriving during
step N (the run stops after it, without a new checkpoint).
``MARIND_TEST_NAN_AT_STEP=N[,M...]`` (or ``[fault] nan_at_step``)
puts a NaN into rank 0's first gradient while computing step N (once); the step
is skipped (parameters and optimizer state untouched, the data moves on)
and logged as ``step_skipped``. After ``train.max_bad_steps`` non-finite
steps in a row the run rolls back to the latest checkpoint, keeping its
data position (so the offending batches are not replayed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from marind.core.workerenv import WorkerEnv
from marind.trainer.build import Run, setup_run
from marind.trainer.config import TrainerSpec
from marind.trainer.data.dataset import rank_sample_indices
from marind.trainer.hf.init_from import init_run_from
from marind.trainer.loop import (
    Finish,
    LoopState,
    Result,
    StepReport,
    StopFlag,
    TrainMode,
    log_due,
    run_loop,
    save_field,
)
from marind.trainer.memory_ckpt import MemoryCheckpointer, open_memory, restore_newest
from marind.trainer.model.gpt import flops_per_token, param_count
from marind.trainer.peak_memory import peak_memory
from marind.trainer.schedule import peak_flops_per_device


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row and no checkpoint to roll back to."""


def nan_steps(spec: TrainerSpec, env: WorkerEnv) -> set[int]:
    """Steps whose gradient the NaN test hook poisons: ``[fault] nan_at_step`` and ``MARIND_TEST_NAN_AT_STEP``."""
    steps = {spec.fault.nan_at_step} if spec.fault.nan_at_step else set()
    return steps | set(env.test_nan_at_steps)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


class ElasticMode(TrainMode):
    """The elastic loop's hooks: own step count, non-finite steps skipped, rollback, MFU; rank 0's grad norm and
    learning rate in its reports (the agent turns them into TensorBoard/W&B curves: ``marind.agent.run_history``)."""

    def __init__(self) -> None:
        self.bad = 0                      # non-finite steps in a row
        self.nan_steps: set[int] = set()
        self.flops_tok = 0.0
        self.peak = 1.0
        self.metrics: dict[str, float] | None = None    # rank 0's last grad norm and lr, for its report
        self.setup_peak = 0.0            # peak memory before the first step (model built, no optimizer state)
        self.memory: MemoryCheckpointer | None = None   # ``[checkpoint] memory_every`` (marind.trainer.memory_ckpt)

    def start(self, run: Run, state: LoopState) -> None:
        """train_start; restore the latest checkpoint (step and data position), else ``[model] init_from``."""
        spec, ckpt, log, t = run.spec, run.ckpt, run.log, run.spec.train
        self.setup_peak = peak_memory(run.device)["peak_memory_bytes"]
        self.flops_tok = flops_per_token(run.cfg)
        self.peak = peak_flops_per_device(run.device, int(os.environ.get("LOCAL_WORLD_SIZE", run.world))) * run.world
        if run.rank == 0:
            log.info("train_start", world_size=run.world, layout=run.layout.as_dict(), grad_accum=run.accum,
                     params=param_count(run.cfg), flops_per_token=self.flops_tok, device=str(run.device),
                     steps=t.steps)
        restored = None
        if ckpt.enabled:
            run.progress.update(phase="restoring")
            self.memory = open_memory(spec, run.model, run.optimizer,
                                      ckpt.store.prepare_timeout_s if ckpt.store is not None else None)
            if self.memory is not None:
                restored, pick = restore_newest(ckpt, self.memory, run.rank)
                run.progress.update(restore=pick.record())   # a fallback: the agent's checkpoint_memory_fallback
            else:
                restored = ckpt.restore()
            if restored:
                state.step, state.position = restored
                if run.rank == 0:
                    log.info("restored", step=state.step, data_position=state.position, url=ckpt.url)
        if restored is None:
            init_run_from(run)   # [model] init_from: only a run with no checkpoint starts from it
        run.progress.update(phase="training", step=state.step, last_checkpoint_step=ckpt.last_step)
        self.nan_steps = nan_steps(spec, run.env)

    def next_step(self, run: Run, state: LoopState) -> bool:
        """Until ``train.steps``."""
        return state.step < run.spec.train.steps

    def sample_indices(self, run: Run, state: LoopState, micro_step: int) -> Sequence[int]:
        """This rank's slice of the samples after ``state.position``."""
        return rank_sample_indices(state.position, micro_step=micro_step, micro_batch=run.spec.data.micro_batch,
                                   dp_rank=run.layout.dp_rank, dp_size=run.layout.dp_size)

    def on_gradients(self, run: Run, state: LoopState) -> None:
        """The NaN test hook: poison rank 0's first gradient once per step number (also after a rollback)."""
        if state.step + 1 in self.nan_steps:
            self.nan_steps.discard(state.step + 1)
            if run.rank == 0:
                grad = run.params[0].grad
                assert grad is not None, "the first parameter has no gradient"
                (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))

    def commit(self, run: Run, state: LoopState, grad_norm: torch.Tensor) -> bool:
        """A finite gradient norm commits; a non-finite one skips the step (``step_skipped``)."""
        if bool(torch.isfinite(grad_norm)):
            self.bad = 0
            return True
        self.bad += 1
        run.log.warning("step_skipped", step=state.step + 1, grad_norm=float(grad_norm), bad_in_a_row=self.bad,
                        reason="non-finite gradient norm")
        return False

    def advance(self, run: Run, state: LoopState, committed: bool) -> None:
        """One step further, ``data.global_batch`` samples further (committed or not: the data moves on)."""
        state.step += 1
        state.position += run.spec.data.global_batch

    def report_step(self, run: Run, state: LoopState, report: StepReport) -> None:
        """Rank 0: the ``step`` line (tokens/s, MFU, memory) every ``train.log_every`` steps; the grad norm and
        learning rate of every step for its report (``progress_fields``)."""
        if run.rank != 0:
            return
        norm = float(report.grad_norm)
        self.metrics = {"grad_norm": norm, "lr": float(report.lr)}
        if not log_due(report.step, run.spec):
            return
        run.log.info("step", step=report.step, loss=round(report.loss, 6), grad_norm=round(norm, 6), lr=report.lr,
                     tokens_per_s=round(report.tokens_per_s, 1),
                     mfu=round(self.flops_tok * report.tokens_per_s / self.peak, 6),
                     memory_bytes=_memory_bytes(run.device), step_s=round(report.step_s, 4),
                     **save_field(report), **report.router)

    def progress_fields(self) -> dict[str, Any]:
        """Rank 0's report carries the step's grad norm and learning rate as its metrics."""
        return {"metrics": self.metrics} if self.metrics is not None else {}

    def after_step(self, run: Run, state: LoopState) -> None:
        """After ``train.max_bad_steps`` non-finite steps in a row: back to the latest checkpoint."""
        if self.bad >= run.spec.train.max_bad_steps:
            state.step = _rollback(run, state)
            state.rollbacks += 1
            self.bad = 0
            if self.memory is not None:
                self.memory.drop_newer(state.step, run.rank)   # the steps rolled back past are not reused
        if self.memory is not None:
            self.memory.poll()
            if self.memory.due(state.step) and state.step < run.spec.train.steps:
                self.memory.save(state.step, run.ckpt.build_state(state.step, state.position))

    def save_due(self, run: Run, state: LoopState, committed: bool, time_due: bool) -> bool:
        """Every ``checkpoint.every_steps`` steps, or when ``checkpoint.every_seconds`` passed."""
        return run.ckpt.due(state.step) or time_due

    def final_save_due(self, run: Run, state: LoopState) -> bool:
        """Always: the last step is saved (a no-op when checkpoints are off)."""
        return True

    def save_on_stop(self, run: Run, state: LoopState) -> bool:
        """``checkpoint.on_stop``: a stop saves the step reached (torchrun's SIGTERM when the job resizes,
        a cancel, a drain), so the next round resumes there."""
        return run.spec.checkpoint.on_stop

    def finish(self, run: Run, state: LoopState) -> Finish:
        """Wait for the save in flight (a timeout is logged); the final record's metrics:
        peak memory (and pipeline stage timing when ``MARIND_BENCH_PP_TIMING`` asked for it)."""
        try:
            run.ckpt.wait()
        except TimeoutError as exc:
            run.log.error("checkpoint_wait_timeout", error=str(exc))
        if self.memory is not None:    # a run that is done frees its hosts' memory; a stopped one keeps it
            self.memory.close(clear=not state.stopped)
        return Finish(log_fields={"last_checkpoint_step": run.ckpt.last_step},
                      record_fields={"metrics": _final_metrics(run, self.setup_peak)})


def train(spec: TrainerSpec, device: torch.device, *, stop: StopFlag | None = None,
          env: WorkerEnv | None = None) -> tuple[Result, torch.nn.Module, torch.optim.Optimizer]:
    """Train in elastic mode to ``train.steps`` or a stop (collective: every rank of the world calls it).

    Args:
        spec: the run's spec (validated for this world).
        device: this rank's device (``marind.distributed.init_distributed``).
        stop: the stop flag (installed by ``marind.trainer.main``); a fresh one when None.
        env: the worker environment; read from ``os.environ`` when None.

    Returns:
        (result, model, optimizer).

    Raises:
        TrainingDiverged: too many non-finite steps in a row and no checkpoint to roll back to.
        ValueError: the spec does not fit the data (see ``marind.trainer.build.build``), or a
            ``MARIND_TEST_*`` variable is malformed.
        ckpt_store.CheckpointSaveFailed: the final checkpoint did not commit.
    """
    env = env if env is not None else WorkerEnv.from_environ()
    mode = ElasticMode()
    run = setup_run(spec, device, env, mode)
    result = run_loop(run, mode, stop or StopFlag())
    return result, run.model, run.optimizer


def _final_metrics(run: Run, setup_peak: float) -> dict[str, float]:
    """The final progress record's metrics: this rank's peak memory (``marind.trainer.peak_memory``) and,
    when a benchmark asked for it, its pipeline stages' timing (``marind.trainer.parallel.pipeline_timing``)."""
    timer = run.pipeline.timer if run.pipeline is not None else None
    return {**peak_memory(run.device), "setup_peak_memory_bytes": setup_peak, **(timer.metrics() if timer else {})}


def _rollback(run: Run, state: LoopState) -> int:
    ckpt = run.ckpt
    if not ckpt.enabled or ckpt.latest() is None:
        raise TrainingDiverged(f"{run.spec.train.max_bad_steps} non-finite steps in a row at step {state.step} "
                               f"and no checkpoint to roll back to; lower optim.lr or enable [checkpoint]")
    ckpt.wait()
    restored = ckpt.restore()
    if restored is None:
        raise TrainingDiverged(f"the checkpoint to roll back to at step {state.step} went away")
    run.log.warning("rolled_back", from_step=state.step, to_step=restored[0], data_position=state.position)
    return restored[0]


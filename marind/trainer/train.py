"""The training loop: build, restore, step, checkpoint, report, stop cleanly.

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
import signal
import time
from dataclasses import dataclass

import psutil
import structlog
import torch
import torch.distributed as dist

from marind.core.log import get_logger
from marind.core.progress import ProgressWriter
from marind.core.spec import RunSpec, grad_accum_steps
from marind.core.workerenv import WorkerEnv
from marind.trainer.checkpointing import Checkpointer
from marind.trainer.data import Sampler, TokenDataset, rank_sample_indices
from marind.trainer.model import GPT, ModelConfig, flops_per_token, lm_loss, param_count
from marind.trainer.parallel import build_mesh, clip_grad_norm, parallelize
from marind.trainer.schedule import lr_at, peak_flops_per_device

STOP_EXIT_CODE = 143  # stopped by SIGTERM/SIGINT after a clean shutdown


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class Result:
    step: int
    data_position: int
    loss: float | None
    losses: list
    skipped_steps: list
    rollbacks: int
    stopped: bool
    last_checkpoint_step: int | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop stops at the next step boundary (agreed by all ranks)."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now, the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True


def _nan_steps(spec: RunSpec) -> set[int]:
    steps = {spec.fault.nan_at_step} if spec.fault.nan_at_step else set()
    env = os.environ.get("MARIND_TEST_NAN_AT_STEP", "")
    steps |= {int(s) for s in env.split(",") if s.strip()}
    return steps


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


def build(spec: RunSpec, device: torch.device):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, layout = build_mesh(spec, world, device.type)
    dataset = TokenDataset(spec.data.path)
    cfg = ModelConfig.from_spec(spec.model, seq_len=spec.data.seq_len, data_vocab_size=dataset.vocab_size)
    if cfg.vocab_size < dataset.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.vocab_size} is smaller than the data's vocabulary "
                         f"({dataset.vocab_size}); raise it or remove it")
    torch.manual_seed(spec.train.seed)  # identical initial weights on every rank
    with torch.device(device):
        model = GPT(cfg)
    parallelize(model, mesh, spec)
    o = spec.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  foreach=layout.tp == 1)
    return model, optimizer, cfg, layout, Sampler(dataset, spec.data.seq_len, spec.train.seed), rank, world


def train(spec: RunSpec, device: torch.device, *, stop: StopFlag | None = None):
    """Run to `train.steps` (or a stop); returns (Result, model, optimizer)."""
    stop = stop or StopFlag()
    model, optimizer, cfg, layout, sampler, rank, world = build(spec, device)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    structlog.contextvars.bind_contextvars(rank=rank, **({"job": os.environ["MARIND_JOB_ID"]}
                                                         if os.environ.get("MARIND_JOB_ID") else {}))
    log = get_logger("trainer")
    progress = ProgressWriter(rank, local_rank, world, WorkerEnv.from_environ().run_dir)
    ckpt = Checkpointer(spec, model, optimizer, rank=rank, world_size=world, layout=layout.as_dict())
    accum = grad_accum_steps(spec, layout.dp_size)
    d, o, t = spec.data, spec.optim, spec.train
    tokens_per_step = d.global_batch * d.seq_len
    flops_tok = flops_per_token(cfg)
    peak = peak_flops_per_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", world))) * world
    if rank == 0:
        log.info("train_start", world_size=world, layout=layout.as_dict(), grad_accum=accum,
                 params=param_count(cfg), flops_per_token=flops_tok, device=str(device), steps=t.steps)

    step, position = 0, 0
    if ckpt.enabled:
        progress.update(phase="restoring")
        restored = ckpt.restore()
        if restored:
            step, position = restored
            if rank == 0:
                log.info("restored", step=step, data_position=position, url=ckpt.store.url)
    progress.update(phase="training", step=step, last_checkpoint_step=ckpt.last_step)

    params = [p for p in model.parameters()]
    nan_steps = _nan_steps(spec)
    stop_at = int(os.environ.get("MARIND_TEST_STOP_AT_STEP", "0") or 0)
    tb = _tensorboard(spec, rank)
    losses, skipped, rollbacks, bad, loss_val, stopped = [], [], 0, 0, None, False
    t_last = time.perf_counter()  # step time runs end to end, so checkpoint stalls count
    while step < t.steps:
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=t.steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_acc = torch.zeros((), device=device)
        for k in range(accum):
            x, y = sampler.batch(rank_sample_indices(position, micro_step=k, micro_batch=d.micro_batch,
                                                     dp_rank=layout.dp_rank, dp_size=layout.dp_size), device)
            loss = lm_loss(model(x), y) / accum
            loss.backward()
            loss_acc += loss.detach()
        if step + 1 in nan_steps:
            nan_steps.discard(step + 1)  # once per step number, also after a rollback
            if rank == 0:
                grad = params[0].grad
                (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))
        norm = clip_grad_norm(params, o.grad_clip)
        finite = bool(torch.isfinite(norm))
        if finite:
            optimizer.step()
            bad = 0
        else:
            bad += 1
        optimizer.zero_grad(set_to_none=True)
        flags = torch.stack([loss_acc.float(), torch.tensor(float(stop.requested or step + 1 == stop_at), device=device),
                             torch.tensor(float(rank == 0 and ckpt.time_due()), device=device)])
        dist.all_reduce(flags)
        step += 1
        position += d.global_batch
        loss_val = float(flags[0]) / world
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        tps = tokens_per_step / dt
        if finite:
            losses.append(loss_val)
        else:
            skipped.append(step)
            log.warning("step_skipped", step=step, grad_norm=float(norm), bad_in_a_row=bad,
                        reason="non-finite gradient norm")
        if rank == 0 and (step % t.log_every == 0 or step == t.steps):
            log.info("step", step=step, loss=round(loss_val, 6), grad_norm=round(float(norm), 6), lr=lr,
                     tokens_per_s=round(tps, 1), mfu=round(flops_tok * tps / peak, 6),
                     memory_bytes=_memory_bytes(device), step_s=round(dt, 4))
            if tb:
                for k_, v in (("loss", loss_val), ("grad_norm", float(norm)), ("lr", lr), ("tokens_per_s", tps)):
                    tb.add_scalar(k_, v, step)
        if bad >= t.max_bad_steps:
            step, rollbacks, bad = _rollback(ckpt, log, step, position, rank), rollbacks + 1, 0
        progress.update(step=step, loss=loss_val, tokens_per_s=tps, last_checkpoint_step=ckpt.poll())
        if float(flags[1]) > 0:
            stopped = True
            break
        if step < t.steps and (ckpt.due(step) or float(flags[2]) > 0):
            progress.update(phase="checkpointing")
            ckpt.save(step, position)
            progress.update(phase="training", last_checkpoint_step=ckpt.last_step)

    if not stopped:
        progress.update(phase="checkpointing")
        ckpt.save(step, position, wait=True)
    try:
        ckpt.wait()
    except TimeoutError as exc:
        log.error("checkpoint_wait_timeout", error=str(exc))
    if rank == 0:
        log.info("stopping" if stopped else "train_done", step=step, loss=loss_val,
                 last_checkpoint_step=ckpt.last_step)
    if tb:
        tb.close()
    progress.update(phase="done", step=step, last_checkpoint_step=ckpt.last_step)
    return Result(step, position, loss_val, losses, skipped, rollbacks, stopped, ckpt.last_step), model, optimizer


def _rollback(ckpt: Checkpointer, log, step: int, position: int, rank: int) -> int:
    if not ckpt.enabled or ckpt.latest() is None:
        raise TrainingDiverged(f"{ckpt.spec.train.max_bad_steps} non-finite steps in a row at step {step} "
                               f"and no checkpoint to roll back to; lower optim.lr or enable [checkpoint]")
    ckpt.wait()
    restored_step, _ = ckpt.restore()
    log.warning("rolled_back", from_step=step, to_step=restored_step, data_position=position)
    return restored_step


def _tensorboard(spec: RunSpec, rank: int):
    if rank != 0 or not spec.train.tensorboard_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        get_logger("trainer").info("tensorboard_unavailable", hint="pip install tensorboard")
        return None
    return SummaryWriter(spec.train.tensorboard_dir)

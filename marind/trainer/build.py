"""Everything a training run holds before its first step: model, optimizer, data, checkpointer, progress.

:func:`build` makes the model (on the meta device, parallelized, then materialized shard by shard
with initial weights that do not depend on the layout: ``marind.trainer.model.meta_init``), its parallel layout
and the AdamW optimizer; :func:`setup_run` adds what the loop reports through (logger with
the rank bound, progress record, checkpointer) and returns them together as a :class:`Run`,
the one object ``marind.trainer.loop`` and its modes share.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch
import torch.distributed as dist

from marind.core.log import get_logger
from marind.core.workerenv import WorkerEnv
from marind.trainer.checkpointing import Checkpointer
from marind.trainer.config import TrainerSpec, grad_accum_steps
from marind.trainer.data.dataset import Sampler, TokenDataset
from marind.trainer.model.gpt import GPT, ModelConfig
from marind.trainer.parallel.mesh import Layout, build_mesh, parallelize
from marind.trainer.parallel.pipeline import Pipeline, StageModel, build_pipeline
from marind.trainer.parallel.pipeline_ckpt import StageArrays
from marind.worker.reporting import Reporter


class ModeSetup(Protocol):
    """What :func:`setup_run` asks of a training mode (``loop.TrainMode`` has both): declared here, so
    this module does not import the loop that imports it."""

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called on the fresh model and optimizer, before the checkpointer exists."""
        ...

    def log_context(self) -> dict[str, Any]:
        """Fields bound to every log line of the run (besides ``rank`` and ``job``)."""
        ...


@dataclass
class Built:
    """The model side of a run, as :func:`build` makes it."""

    model: GPT | StageModel
    optimizer: torch.optim.Optimizer
    cfg: ModelConfig
    layout: Layout
    sampler: Sampler
    rank: int
    world: int
    pipeline: Pipeline | None = None


def build(spec: TrainerSpec, device: torch.device) -> Built:
    """Model, layout, optimizer and sampler of this rank (collective: every rank calls it).

    Args:
        spec: the run's spec.
        device: this rank's device.

    Returns:
        The built parts.

    Raises:
        ValueError: ``model.vocab_size`` is smaller than the data's vocabulary.
        OSError: the dataset cannot be read.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = TokenDataset(spec.data.path)
    cfg = ModelConfig.from_spec(spec.model, seq_len=spec.data.seq_len, data_vocab_size=dataset.vocab_size)
    if cfg.vocab_size < dataset.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.vocab_size} is smaller than the data's vocabulary "
                         f"({dataset.vocab_size}); raise it or remove it")
    torch.manual_seed(spec.train.seed)  # the global generator, for anything else that draws from it
    pipeline = None
    model: torch.nn.Module
    if spec.parallel.pp > 1:            # stages of the model per rank (marind.trainer.parallel.pipeline)
        model, layout, meshes, pieces = build_pipeline(spec, cfg, world, device)
        pipeline = Pipeline(spec, meshes, pieces, device, grad_accum_steps(spec, layout.dp_size))
    else:
        mesh, layout = build_mesh(spec, world, device.type)
        with torch.device("meta"):      # no memory: each rank materializes its own shards only
            model = GPT(cfg)
        parallelize(model, mesh, spec)
        model.to_empty(device=device)
        model.init_weights(seed=spec.train.seed)   # the same global weights in every layout (meta_init)
    o = spec.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  foreach=layout.tp == 1 and layout.ep == 1)   # one mesh for all params
    return Built(model, optimizer, cfg, layout, Sampler(dataset, spec.data.seq_len, spec.train.seed), rank, world,
                 pipeline)


@dataclass
class Run:
    """One rank's training run: what the loop and its mode read and drive.

    Attributes:
        spec: the run's spec.
        device: this rank's device.
        env: what marind told the worker (``MARIND_*``).
        model, optimizer, cfg, layout, sampler, rank, world: as :func:`build` made them.
        local_rank: rank on this node (torchrun's ``LOCAL_RANK``).
        log: the trainer's logger, with ``rank`` (and the mode's context) bound.
        progress: this rank's progress record (``marind.worker.reporting.Reporter``).
        ckpt: durable checkpoints through ckpt_store.
        accum: micro-batches per step on this rank.
        params: the model's parameters, in order.
        pipeline: this rank's pipeline stages and schedule (``parallel.pp`` > 1), else None.
    """

    spec: TrainerSpec
    device: torch.device
    env: WorkerEnv
    model: GPT | StageModel
    optimizer: torch.optim.Optimizer
    cfg: ModelConfig
    layout: Layout
    sampler: Sampler
    rank: int
    world: int
    local_rank: int
    log: Any
    progress: Reporter
    ckpt: Checkpointer
    accum: int
    params: list[torch.nn.Parameter]
    pipeline: Pipeline | None = None


def setup_run(spec: TrainerSpec, device: torch.device, env: WorkerEnv, mode: ModeSetup) -> Run:
    """Build this rank's run: :func:`build`, ``mode.prepare``, logging context, progress, checkpointer.

    Args:
        spec: the run's spec.
        device: this rank's device.
        env: the worker environment.
        mode: the training mode (its ``prepare`` runs on the fresh model and optimizer).

    Returns:
        The run, before anything is restored.

    Raises:
        ValueError: see :func:`build`.
    """
    b = build(spec, device)
    mode.prepare(b.model, b.optimizer)
    local_rank = int(os.environ.get("LOCAL_RANK", b.rank))
    structlog.contextvars.bind_contextvars(rank=b.rank, **mode.log_context(),
                                           **({"job": env.job_id} if env.job_id else {}))
    log = get_logger("trainer")
    progress = Reporter(b.rank, local_rank, b.world, env.run_dir)
    ckpt = Checkpointer(spec, b.model, b.optimizer, rank=b.rank, world_size=b.world, layout=b.layout.as_dict(),
                        model_config=dataclasses.asdict(b.cfg),
                        stage_arrays=StageArrays(device.type) if b.pipeline is not None else None)
    ckpt.on_error = lambda reason: progress.update(checkpoint_error=reason)   # status and events say why
    return Run(spec=spec, device=device, env=env, model=b.model, optimizer=b.optimizer, cfg=b.cfg,
               layout=b.layout, sampler=b.sampler, rank=b.rank, world=b.world, local_rank=local_rank, log=log,
               progress=progress, ckpt=ckpt, accum=grad_accum_steps(spec, b.layout.dp_size),
               params=list(b.model.parameters()), pipeline=b.pipeline)

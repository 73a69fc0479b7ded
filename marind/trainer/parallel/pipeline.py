"""Pipeline parallelism: the GPT split into stages by layers, their meshes, schedule and step.

The world is a ``(pp, dp_replicate, dp_shard, tp)`` mesh, ``pp`` outermost. Each pipeline rank
holds one stage (``1F1B``, ``GPipe``) or several virtual stages (``Interleaved1F1B``: stages r,
r + pp, ...; ``marind.trainer.parallel.pipeline_spec``). The whole GPT is built on the ``meta`` device
(free), cut into :class:`StageModel` pieces that keep the global module names (the layers sit in
a ``ModuleDict`` keyed by their global index, so a stage's parameter is
``layers.7.attention.wq.weight``, never a stage-local ``layers.0``), each piece parallelized
(TP, activation checkpointing, compile, FSDP2: ``marind.trainer.parallel.mesh.parallelize``), then
materialized and filled per parameter by global name (``marind.trainer.model.meta_init``): the same
initial weights as the unsplit model.

Each stage's FSDP/TP mesh is a mesh of its own (a root, not a slice of the world mesh), so that a
checkpoint sees a stage's arrays as held by that stage alone rather than as copies on every
stage (``marind.trainer.parallel.pipeline_ckpt``). The ``pp`` slice of the world mesh carries the
activations and the loss; gradient clipping sums over it (``marind.trainer.parallel.grad_norm``).

:meth:`Pipeline.forward_backward` replaces the loop's micro-batch loop: the rank's ``accum``
micro-batches of a step, drawn through the callable the loop hands it (so this module needs
neither the loop nor its ``Run``), run as ``accum / pp_microbatches`` schedule runs, each
micro-batch's loss ``lm_loss / accum`` as in the unsplit loop (so gradients match it up to float order);
only the last stage has a loss, the other ranks return zero (the loop divides the all-reduced
loss by the ranks that hold the last stage). A mixture-of-experts model's auxiliary losses join
each stage's backward and its router statistics come back in the unsplit model's layout
(``marind.trainer.parallel.pipeline_moe``); expert parallelism runs inside each stage's mesh. A benchmark
can time each rank's stages against the schedule's wall time (``marind.trainer.parallel.pipeline_timing``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from marind.trainer.config import TrainerSpec, validate_for_world
from marind.trainer.model.gpt import GPT, ModelConfig, lm_loss, rotary_tables
from marind.trainer.model.meta_init import init_parameters
from marind.trainer.parallel.expert import expert_mesh
from marind.trainer.parallel.mesh import MESH_DIMS, Layout, parallelize
from marind.trainer.parallel.pipeline_moe import MoEStage, install_sinks, moe_layer_count, router_stats
from marind.trainer.parallel.pipeline_spec import StagePlan, microbatches, stage_plan
from marind.trainer.parallel.pipeline_timing import StageTimer

#: the world mesh's dimensions under pipeline parallelism
PP_MESH_DIMS = ("pp", *MESH_DIMS)

#: draws this rank's micro-batch ``k`` of the current step: ``(tokens, targets)`` on the rank's device
BatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class StageModel(nn.Module):
    """Layers of a GPT under their global names; the embedding if first, final norm and head if last.

    Args:
        gpt: the (meta) model to take the modules from.
        layers: the global indices of the blocks this piece holds.
        first: holds the token embedding (its input is token ids, else activations).
        last: holds the final norm and the LM head (its output is logits).
    """

    def __init__(self, gpt: GPT, layers: range | list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg: ModelConfig = gpt.cfg
        self.tok_embeddings = gpt.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): gpt.layers[i] for i in layers})
        self.norm = gpt.norm if last else None
        self.output = gpt.output if last else None
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)   # recomputed after to_empty (init_buffers)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Fill every parameter by its global name (``meta_init``) and recompute the rotary tables."""
        init_parameters(self, n_layers=self.cfg.n_layers, seed=seed)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary tables (after ``to_empty`` they hold garbage)."""
        cos_buf, sin_buf = self.get_buffer("rope_cos"), self.get_buffer("rope_sin")
        with torch.device(cos_buf.device):
            cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        cos_buf.copy_(cos)
        sin_buf.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first piece) or activations in; activations or logits (last piece) out."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is None:
            return h
        assert self.output is not None, "a pipelined model has an untied head (pipeline_spec)"
        return self.output(self.norm(h))


@dataclass(frozen=True)
class PipelineMeshes:
    """The meshes of a pipeline run.

    Attributes:
        world: ``(pp, dp_replicate, dp_shard, tp)`` over every rank (its ``pp`` slice carries the pipeline).
        stages: per stage rank group, its own ``(dp_replicate, dp_shard, tp)`` mesh (every rank builds all).
        pp_rank: this rank's pipeline coordinate.
        expert_world: with expert parallelism, ``world`` with ``dp_shard`` unflattened into
            ``(edp_shard, ep)`` (the experts' gradients are on such meshes); else None.
    """

    world: DeviceMesh
    stages: tuple[DeviceMesh, ...]
    pp_rank: int
    expert_world: DeviceMesh | None = None

    @property
    def norm_meshes(self) -> tuple[DeviceMesh, ...]:
        """What gradient clipping slices its per-mesh all-reduces from (``grad_norm``): the world mesh,
        and with expert parallelism the world mesh with ``dp_shard`` unflattened into ``(edp_shard, ep)``."""
        return (self.world,) if self.expert_world is None else (self.world, self.expert_world)

    @property
    def stage(self) -> DeviceMesh:
        """This rank's stage mesh."""
        return self.stages[self.pp_rank]


def build_pipeline_mesh(spec: TrainerSpec, world_size: int, device_type: str) -> tuple[PipelineMeshes, Layout]:
    """The world mesh, the stage meshes and this rank's place (collective: every rank calls it).

    Args:
        spec: the run's spec (``[parallel]``).
        world_size: ranks in the world.
        device_type: ``"cuda"`` or ``"cpu"``.

    Returns:
        (meshes, layout).

    Raises:
        SpecError: the layout does not fit ``world_size``.
    """
    dr, ds, tp = validate_for_world(spec, world_size)
    pp = spec.parallel.pp
    world = init_device_mesh(device_type, (pp, dr, ds, tp), mesh_dim_names=PP_MESH_DIMS)
    stages = tuple(DeviceMesh(device_type, world.mesh[s], mesh_dim_names=MESH_DIMS) for s in range(pp))
    expert_world = None
    if spec.parallel.ep > 1 and spec.model.n_experts:   # the unflatten is collective: every rank, every stage
        expert_world = expert_mesh(world, spec.parallel.ep)
        for stage in stages:
            expert_mesh(stage, spec.parallel.ep)
    coord = world.get_coordinate()
    assert coord is not None
    pp_rank = coord[0]
    dp_rank = coord[1] * ds + coord[2]
    return PipelineMeshes(world, stages, pp_rank, expert_world), Layout(dr, ds, tp, dp_rank=dp_rank, pp=pp, ep=spec.parallel.ep)


def split_model(gpt: GPT, plan: StagePlan, pp_rank: int) -> list[StageModel]:
    """The pieces of ``gpt`` that pipeline rank ``pp_rank`` holds, in its stage order."""
    last = plan.stages - 1
    return [StageModel(gpt, plan.stage_layers(s), first=s == 0, last=s == last) for s in plan.rank_stages(pp_rank)]


def rank_model(gpt: GPT, pieces: list[StageModel]) -> StageModel:
    """One module over all of a rank's pieces (the same submodules): what the optimizer and
    checkpoints see. With one piece, that piece."""
    if len(pieces) == 1:
        return pieces[0]
    whole = StageModel(gpt, [], first=False, last=False)
    whole.tok_embeddings = next((p.tok_embeddings for p in pieces if p.tok_embeddings is not None), None)
    whole.layers = nn.ModuleDict({k: m for p in pieces for k, m in p.layers.items()})
    whole.norm = next((p.norm for p in pieces if p.norm is not None), None)
    whole.output = next((p.output for p in pieces if p.output is not None), None)
    return whole


class Pipeline:
    """This rank's stages and schedule; :meth:`forward_backward` runs one step's micro-batches.

    Args:
        spec: the run's spec.
        meshes: the pipeline's meshes.
        pieces: this rank's stage modules (parallelized, materialized).
        device: this rank's device.
        accum: the rank's micro-batches per step (``run.accum``).
    """

    def __init__(self, spec: TrainerSpec, meshes: PipelineMeshes, pieces: list[StageModel], device: torch.device,
                 accum: int) -> None:
        self.plan = stage_plan(spec)
        self.meshes = meshes
        self.microbatches = microbatches(spec)
        self.rounds = accum // self.microbatches
        self.device = device
        self.first = meshes.pp_rank == 0
        self.last = meshes.pp_rank == spec.parallel.pp - 1
        group = meshes.world["pp"].get_group()
        stage_ids = self.plan.rank_stages(meshes.pp_rank)
        m = spec.model
        self.n_moe = moe_layer_count(n_layers=m.n_layers, n_experts=m.n_experts, moe_every=m.moe_every)
        self.n_experts = m.n_experts
        piece_sinks = [install_sinks([piece], n_experts=m.n_experts, moe_every=m.moe_every, scale=1.0 / accum)
                       for piece in pieces]
        self.sinks = [sink for sinks in piece_sinks for sink in sinks]
        self.stages: list[Any] = [MoEStage(piece, s, self.plan.stages, device, group=group, sinks=sinks)
                                  for piece, s, sinks in zip(pieces, stage_ids, piece_sinks)]
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = \
            lambda out, target: lm_loss(out, target) / accum   # the unsplit loop's scaling
        kind = spec.parallel.pp_schedule
        self.schedule: Any
        if kind == "Interleaved1F1B":
            self.schedule = ScheduleInterleaved1F1B(self.stages, self.microbatches, loss_fn=loss_fn,
                                                    scale_grads=False)
        else:
            cls = Schedule1F1B if kind == "1F1B" else ScheduleGPipe
            self.schedule = cls(self.stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)
        self.timer = StageTimer.from_environ(self.stages, self.schedule, device)   # benchmarks only; else None

    @property
    def world_mesh(self) -> DeviceMesh:
        """The ``(pp, dp_replicate, dp_shard, tp)`` mesh."""
        return self.meshes.world

    @property
    def norm_meshes(self) -> tuple[DeviceMesh, ...]:
        """The meshes gradient clipping reduces over with ``pp`` (``PipelineMeshes.norm_meshes``)."""
        return self.meshes.norm_meshes

    def forward_backward(self, batch: BatchFn, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the step's gradients through the schedule: the summed loss on the last stage (else 0)
        and this rank's router statistics in the unsplit model's layout (``pipeline_moe.router_stats``;
        empty for a dense model).

        Args:
            batch: draws the rank's micro-batch ``k`` (0 to ``accum - 1``) of this step.
            step: the steps completed before this one (``LoopState.step``; the benchmark's stage timer).
        """
        loss_acc = torch.zeros((), device=self.device)
        m = self.microbatches
        for r in range(self.rounds):
            xs, ys = zip(*(batch(k) for k in range(r * m, (r + 1) * m)))
            x, y = torch.cat(xs), torch.cat(ys)
            losses: list[torch.Tensor] = []
            args = (x,) if self.first else ()
            if self.timer:
                self.timer.begin(step)
            self.schedule.step(*args, target=y if self.last else None, losses=losses)
            if self.timer:
                self.timer.end()
            if self.last:
                loss_acc += torch.stack([t.detach().float() for t in losses]).sum()
        return loss_acc, router_stats(self.sinks, n_moe=self.n_moe, n_experts=self.n_experts, device=self.device)


def build_pipeline(spec: TrainerSpec, cfg: ModelConfig, world_size: int,
                   device: torch.device) -> tuple[StageModel, Layout, PipelineMeshes, list[StageModel]]:
    """This rank's stage pieces, on meta then parallelized, materialized and initialized.

    Collective: every rank calls it.

    Args:
        spec: the run's spec (``parallel.pp`` > 1).
        cfg: the model's config.
        world_size: ranks in the world.
        device: this rank's device.

    Returns:
        (the rank's model over its pieces, layout, meshes, pieces).
    """
    meshes, layout = build_pipeline_mesh(spec, world_size, device.type)
    with torch.device("meta"):
        gpt = GPT(cfg)
    pieces = split_model(gpt, stage_plan(spec), meshes.pp_rank)
    for piece in pieces:
        parallelize(piece, meshes.stage, spec)   # type: ignore[arg-type]  # a StageModel has .layers
    for piece in pieces:
        piece.to_empty(device=device)
        piece.init_buffers()
    whole = rank_model(gpt, pieces)
    init_parameters(whole, n_layers=cfg.n_layers, seed=spec.train.seed)
    return whole, layout, meshes, pieces

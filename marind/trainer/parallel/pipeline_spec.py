"""Pipeline parallelism's part of the spec: ``[parallel] pp``, ``pp_schedule``, ``pp_microbatches``,
``pp_stages_per_rank``, and the arithmetic they must satisfy (pure, no torch).

* ``pp`` ranks hold consecutive pieces of the model (the outermost mesh dimension); the world is
  ``dp_replicate x dp_shard x tp x pp``.
* ``pp_schedule``: ``"1F1B"`` (one stage per rank), ``"GPipe"`` (one stage per rank, every forward
  before any backward) or ``"Interleaved1F1B"`` (``pp_stages_per_rank`` >= 2 virtual stages per
  rank, rank r holding stages r, r + pp, ...).
* ``pp_microbatches``: micro-batches per schedule run (0: ``pp``), each ``data.micro_batch``
  samples; a step runs ``global_batch / (micro_batch x dp x pp_microbatches)`` schedules.
* Layers split evenly: ``pp x pp_stages_per_rank`` must divide ``model.n_layers``; the embedding
  sits on the first stage, the final norm and the LM head on the last (so embeddings cannot be
  tied across stages).
* Mixture of experts: with ``parallel.ep > 1`` every stage must hold a MoE block (the experts'
  gradients live on meshes of their own, and gradient clipping reduces each kind of mesh over
  all stages at once: ``marind.trainer.parallel.grad_norm``).

The functions read the spec through :class:`PipelineSpecView`, the keys they need, declared here:
``marind.trainer.config`` calls them with its ``TrainerSpec``, so this module does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from marind.core.errors import SpecError


class _ParallelKeys(Protocol):
    @property
    def pp(self) -> int: ...
    @property
    def pp_schedule(self) -> str: ...
    @property
    def pp_microbatches(self) -> int: ...
    @property
    def pp_stages_per_rank(self) -> int: ...
    @property
    def ep(self) -> int: ...


class _ModelKeys(Protocol):
    @property
    def n_layers(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def moe_every(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def init_from(self) -> str: ...


class _FaultKeys(Protocol):
    @property
    def mode(self) -> str: ...


class _DataKeys(Protocol):
    @property
    def micro_batch(self) -> int: ...


class PipelineSpecView(Protocol):
    """The sections of a trainer spec this module reads (``config.TrainerSpec`` has them)."""

    @property
    def parallel(self) -> _ParallelKeys: ...
    @property
    def model(self) -> _ModelKeys: ...
    @property
    def fault(self) -> _FaultKeys: ...
    @property
    def data(self) -> _DataKeys: ...


#: the schedules ``parallel.pp_schedule`` names (torch.distributed.pipelining)
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


@dataclass(frozen=True)
class StagePlan:
    """How the layers split: ``stages`` stages of ``layers_per_stage`` layers, ``per_rank`` per rank."""

    pp: int
    per_rank: int
    n_layers: int

    @property
    def stages(self) -> int:
        """Pipeline stages in all (virtual stages counted)."""
        return self.pp * self.per_rank

    @property
    def layers_per_stage(self) -> int:
        """Transformer blocks of each stage."""
        return self.n_layers // self.stages

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank ``pp_rank`` holds (loop order: r, r + pp, ...)."""
        return [pp_rank + v * self.pp for v in range(self.per_rank)]

    def stage_layers(self, stage: int) -> range:
        """The global layer indices of ``stage``."""
        n = self.layers_per_stage
        return range(stage * n, (stage + 1) * n)


def stages_per_rank(spec: PipelineSpecView) -> int:
    """Virtual stages per pipeline rank: ``pp_stages_per_rank``, or 0's default (2 interleaved, else 1)."""
    p = spec.parallel
    if p.pp_stages_per_rank:
        return p.pp_stages_per_rank
    return 2 if p.pp_schedule == "Interleaved1F1B" else 1


def microbatches(spec: PipelineSpecView) -> int:
    """Micro-batches per schedule run: ``pp_microbatches``, or ``pp`` when 0."""
    return spec.parallel.pp_microbatches or spec.parallel.pp


def stage_plan(spec: PipelineSpecView) -> StagePlan:
    """The layer split of ``spec`` (validated by :func:`validate_pipeline`)."""
    return StagePlan(spec.parallel.pp, stages_per_rank(spec), spec.model.n_layers)


def validate_pipeline(spec: PipelineSpecView) -> None:
    """Check the pipeline keys that need no world size.

    Raises:
        SpecError: the first problem, in one line naming the key and the fix.
    """
    p, m = spec.parallel, spec.model
    if p.pp < 1:
        raise SpecError(f"parallel.pp must be >= 1, got {p.pp}")
    if p.pp_schedule not in PP_SCHEDULES:
        raise SpecError(f"parallel.pp_schedule = {p.pp_schedule!r}: use one of {', '.join(PP_SCHEDULES)}")
    if p.pp_microbatches < 0:
        raise SpecError(f"parallel.pp_microbatches must be >= 1, or 0 for parallel.pp, got {p.pp_microbatches}")
    if p.pp_stages_per_rank < 0:
        raise SpecError(f"parallel.pp_stages_per_rank must be >= 1, or 0 for the schedule's default, "
                        f"got {p.pp_stages_per_rank}")
    if p.pp == 1:
        return
    v = stages_per_rank(spec)
    if p.pp_schedule == "Interleaved1F1B" and v < 2:
        raise SpecError(f"parallel.pp_schedule = \"Interleaved1F1B\" needs parallel.pp_stages_per_rank >= 2, got {v}; "
                        "raise it or use \"1F1B\"")
    if p.pp_schedule != "Interleaved1F1B" and v != 1:
        raise SpecError(f"parallel.pp_stages_per_rank = {v} needs parallel.pp_schedule = \"Interleaved1F1B\" "
                        f"({p.pp_schedule} runs one stage per rank); set it to 1 or change the schedule")
    if m.n_layers % (p.pp * v):
        what = f"parallel.pp x pp_stages_per_rank = {p.pp}x{v} = {p.pp * v}" if v > 1 else f"parallel.pp = {p.pp}"
        raise SpecError(f"{what} must divide model.n_layers = {m.n_layers} (every stage holds as many layers); "
                        "change pp or n_layers")
    mb = microbatches(spec)
    if mb < p.pp:
        raise SpecError(f"parallel.pp_microbatches = {mb} must be >= parallel.pp = {p.pp} (or the pipeline idles); "
                        "raise it")
    if p.pp_schedule == "Interleaved1F1B" and mb % p.pp:
        raise SpecError(f"parallel.pp_microbatches = {mb} must be a multiple of parallel.pp = {p.pp} "
                        "for Interleaved1F1B")
    if m.tie_embeddings:
        raise SpecError("model.tie_embeddings = true cannot be split across pipeline stages (the embedding is on "
                        "the first, the LM head on the last); set model.tie_embeddings = false with parallel.pp > 1")
    if spec.fault.mode == "torchft":
        raise SpecError("parallel.pp > 1 does not run under fault.mode = \"torchft\" yet; use fault.mode = \"elastic\"")
    if m.n_experts and p.ep > 1:
        plan = stage_plan(spec)
        bare = [s for s in range(plan.stages) if not any((layer + 1) % m.moe_every == 0
                                                          for layer in plan.stage_layers(s))]
        if bare:
            raise SpecError(f"parallel.ep = {p.ep} with parallel.pp = {p.pp}: pipeline stage {bare[0]} (layers "
                            f"{plan.stage_layers(bare[0]).start}-{plan.stage_layers(bare[0]).stop - 1}) holds no "
                            f"MoE block (model.moe_every = {m.moe_every}); every stage needs one, so lower "
                            "moe_every, raise the layers per stage or set parallel.ep = 1")
    if m.init_from:
        raise SpecError("model.init_from does not load into pipeline stages yet; start it with parallel.pp = 1 "
                        "and resume with pp from its checkpoint")


def pipeline_world(spec: PipelineSpecView, world_size: int) -> int:
    """The ranks of one pipeline stage: ``world_size / pp``.

    Raises:
        SpecError: ``pp`` does not divide ``world_size``.
    """
    pp = spec.parallel.pp
    if world_size % pp:
        raise SpecError(f"parallel.pp = {pp} does not divide the world size {world_size} "
                        "(world = dp_replicate x dp_shard x tp x pp); change pp or the number of processes")
    return world_size // pp


def check_microbatch_split(spec: PipelineSpecView, accum: int) -> None:
    """The rank's micro-batches of a step (``accum``) must fill whole schedule runs.

    Raises:
        SpecError: ``accum`` is not a multiple of the schedule's micro-batches.
    """
    if spec.parallel.pp == 1:
        return
    mb = microbatches(spec)
    if accum % mb:
        d = spec.data
        raise SpecError(f"the per-rank batch of data.global_batch / dp = {accum * d.micro_batch} samples does not "
                        f"divide into parallel.pp_microbatches = {mb} micro-batches of data.micro_batch = "
                        f"{d.micro_batch}; make global_batch a multiple of micro_batch x dp x pp_microbatches")

"""The reference trainer's config: its sections of run.toml, presets and batch arithmetic.

The core spec (``marind.core.spec.RunSpec``) types marind's own sections
(``[job] [checkpoint] [fault]``) and keeps every other one raw; this module
types the trainer's (``[model] [parallel] [data] [optim] [train]``) from it:

* ``trainer_spec(run)`` builds a ``TrainerSpec`` from a core spec and
  validates it (unknown trainer sections and keys rejected with a
  did-you-mean, the model preset resolved, every world size of
  ``job.nodes`` checked); ``load_trainer_spec(path_or_text)`` does both
  steps from a run.toml. ``marind submit`` runs it for trainer jobs, so a
  bad trainer spec never reaches etcd.
* A relative ``data.path`` / ``train.tensorboard_dir`` resolves against
  ``job.working_dir`` when that is absolute (``marind submit`` makes it so).
* ``resolve_mesh(spec, world_size)`` gives ``(dp_replicate, dp_shard, tp)``
  for a world size; ``grad_accum_steps`` and ``validate_for_world`` check
  the batch arithmetic.

Presets live here because validation needs the head count: ``tp`` must
divide ``n_heads`` and the MLP width.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marind.core.errors import SpecError
from marind.core.schema import did_you_mean, parse_table, spec_field
from marind.core.spec import (
    CORE_SECTIONS,
    CheckpointSpec,
    FaultSpec,
    JobSpec,
    RunSpec,
    load_spec,
    positive,
    section_table,
)
from marind.trainer.model.moe_spec import MOE_PRESETS, preset_dims, resolve_moe, validate_ep_for_world, validate_moe
from marind.trainer.parallel.pipeline_spec import check_microbatch_split, pipeline_world, validate_pipeline

# ---------------------------------------------------------------- presets

def swiglu_hidden(dim: int) -> int:
    """MLP width for a model width: 8/3 x dim rounded up to a multiple of 64."""
    return int(math.ceil(8 * dim / 3 / 64) * 64)


#: name -> (dim, n_layers, n_heads). vocab_size comes from the data unless set.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (64, 2, 4),
    "small": (256, 4, 4),
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 16),
    "1.3b": (2048, 24, 16),
    "2.7b": (2560, 32, 32),
    "6.7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
}

# ---------------------------------------------------------------- sections

@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    preset: str = spec_field("tiny", "str")
    dim: int = spec_field(0, "int")
    n_layers: int = spec_field(0, "int")
    n_heads: int = spec_field(0, "int")
    ffn_dim: int = spec_field(0, "int")
    vocab_size: int | None = spec_field(None, "int?")   # None: from the prepared data
    tie_embeddings: bool = spec_field(True, "bool")
    norm_eps: float = spec_field(1e-5, "float")
    rope_theta: float = spec_field(10000.0, "float")
    init_from: str = spec_field("", "str")   # a Hugging Face Llama directory to start from ("" = random init)
    # mixture of experts (marind.trainer.model.moe; checks in marind.trainer.model.moe_spec); n_experts 0 = dense
    n_experts: int = spec_field(0, "int")
    top_k: int = spec_field(2, "int")
    n_shared_experts: int = spec_field(0, "int")
    moe_every: int = spec_field(1, "int")           # every k-th block is MoE
    moe_ffn_dim: int = spec_field(0, "int")         # one expert's hidden width; 0 = ffn_dim
    capacity_factor: float = spec_field(0.0, "float")   # 0 = dropless
    router_z_loss_coef: float = spec_field(1e-3, "float")
    load_balance_coef: float = spec_field(1e-2, "float")


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    dp_replicate: int = spec_field(1, "int")
    dp_shard: int = spec_field(-1, "int")
    tp: int = spec_field(1, "int")
    ep: int = spec_field(1, "int")          # expert parallelism, borrowed from dp_shard (trainer/parallel/expert.py)
    mixed_precision: str = spec_field("fp32", "str")        # "fp32" | "bf16"
    activation_checkpointing: bool = spec_field(False, "bool")
    compile: bool = spec_field(False, "bool")
    pp: int = spec_field(1, "int")                          # pipeline stages (marind.trainer.parallel.pipeline_spec)
    pp_schedule: str = spec_field("1F1B", "str")            # "1F1B" | "Interleaved1F1B" | "GPipe"
    pp_microbatches: int = spec_field(0, "int")             # per schedule run; 0 = pp
    pp_stages_per_rank: int = spec_field(0, "int")          # virtual stages; 0 = 2 interleaved, else 1


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    path: str = spec_field("", "str")
    seq_len: int = spec_field(256, "int")
    global_batch: int = spec_field(32, "int")
    micro_batch: int = spec_field(4, "int")


@dataclass(frozen=True, kw_only=True)
class OptimSpec:
    lr: float = spec_field(3e-4, "float")
    min_lr: float = spec_field(3e-5, "float")
    warmup_steps: int = spec_field(20, "int")
    weight_decay: float = spec_field(0.1, "float")
    beta1: float = spec_field(0.9, "float")
    beta2: float = spec_field(0.95, "float")
    eps: float = spec_field(1e-8, "float")
    grad_clip: float = spec_field(1.0, "float")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    steps: int = spec_field(200, "int")
    seed: int = spec_field(1234, "int")
    log_every: int = spec_field(1, "int")
    max_bad_steps: int = spec_field(3, "int")     # non-finite steps in a row before a rollback
    tensorboard_dir: str = spec_field("", "str")  # an older name for [job] tensorboard_dir (the agent writes there)


#: The trainer's own sections of run.toml.
TRAINER_SECTIONS: dict[str, type] = {
    "model": ModelSpec, "parallel": ParallelSpec, "data": DataSpec, "optim": OptimSpec, "train": TrainSpec,
}


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """A trainer job's spec: the core sections and the trainer's, all typed."""

    job: JobSpec = field(default_factory=JobSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    fault: FaultSpec = field(default_factory=FaultSpec)

    def to_dict(self) -> dict:
        """JSON-able form with the TOML key names; ``from_dict`` reads it back."""
        return {name: section_table(getattr(self, name)) for name in (*CORE_SECTIONS, *TRAINER_SECTIONS)}

    @classmethod
    def from_dict(cls, data: Mapping, *, check_worlds: bool = True) -> TrainerSpec:
        """Parse and validate a spec dict (``to_dict``'s form, or parsed TOML).

        Raises:
            SpecError: the spec is invalid (one line).
        """
        return trainer_spec(RunSpec.from_dict(data), check_worlds=check_worlds)

    def core(self) -> RunSpec:
        """The core spec of this job (the trainer's sections raw, as stored in etcd)."""
        d = self.to_dict()
        return RunSpec(job=self.job, checkpoint=self.checkpoint, fault=self.fault,
                       sections={name: d[name] for name in TRAINER_SECTIONS})

    def world_sizes(self) -> list[int]:
        """Every world size this job may run at (``RunSpec.world_sizes``)."""
        return RunSpec(job=self.job, fault=self.fault).world_sizes()

    def replace(self, **sections) -> TrainerSpec:
        return dataclasses.replace(self, **sections)


# ---------------------------------------------------------------- building

def load_trainer_spec(src: str | os.PathLike, *, check_worlds: bool = True) -> TrainerSpec:
    """A trainer spec from a run.toml path or TOML text (``load_spec``, then ``trainer_spec``).

    A ``.json`` path is the spec document the agent stores in etcd.

    Raises:
        SpecError: the spec is invalid (one line).
    """
    if isinstance(src, (str, os.PathLike)) and str(src).endswith(".json") and "\n" not in str(src):
        try:
            doc = json.loads(Path(src).read_text())
        except (OSError, ValueError) as exc:
            raise SpecError(f"cannot read spec {src}: {exc}; check the path") from exc
        return TrainerSpec.from_dict(doc, check_worlds=check_worlds)
    return trainer_spec(load_spec(src), check_worlds=check_worlds)


def trainer_spec(run: RunSpec, *, check_worlds: bool = True) -> TrainerSpec:
    """Type and validate the trainer's sections of a core spec.

    Args:
        run: the core spec (its ``sections`` hold the trainer's, raw).
        check_worlds: also check the mesh and batch arithmetic at every world size of ``job.nodes``.

    Returns:
        The trainer's spec.

    Raises:
        SpecError: an unknown section or key, a bad value, or batch arithmetic that does not work.
    """
    typed: dict[str, Any] = {}
    given_model: set[str] = set()
    for name, raw in run.sections.items():
        if name not in TRAINER_SECTIONS:
            known = [*CORE_SECTIONS, *TRAINER_SECTIONS]
            raise SpecError(f"unknown section [{name}]{did_you_mean(name, known)}; remove or rename it")
        typed[name], given = parse_table(TRAINER_SECTIONS[name], raw, name)
        if name == "model":
            given_model = given
    if "data" not in typed or not typed["data"].path:
        raise SpecError("data.path is required: the prefix of a prepared .bin/.idx pair "
                        "(make one with `marind data prepare`)")
    typed["model"] = _resolve_model(typed.get("model", ModelSpec()), given_model)
    job = run.job
    if run.runs_trainer and not job.preload:        # what the zygote imports for the trainer
        from marind.trainer import MARIND_PRELOAD, MARIND_PRELOAD_TORCHFT
        extra = MARIND_PRELOAD_TORCHFT if run.fault.mode == "torchft" else ()
        job = dataclasses.replace(job, preload=(*MARIND_PRELOAD, *extra))
    spec = TrainerSpec(job=job, checkpoint=run.checkpoint, fault=run.fault, **typed)
    spec = _resolve_trainer_paths(spec)
    validate_trainer_spec(spec, check_worlds=check_worlds)
    return spec


def _resolve_trainer_paths(spec: TrainerSpec) -> TrainerSpec:
    """Relative data and TensorBoard paths against an absolute working dir (set at submit)."""
    wd = spec.job.working_dir
    if not wd or not os.path.isabs(wd):
        return spec

    def under(path: str) -> str:
        return path if not path or os.path.isabs(os.path.expanduser(path)) else str(Path(wd) / path)
    return spec.replace(data=dataclasses.replace(spec.data, path=under(spec.data.path)),
                        train=dataclasses.replace(spec.train, tensorboard_dir=under(spec.train.tensorboard_dir)),
                        model=dataclasses.replace(spec.model, init_from=under(spec.model.init_from)))


def missing_data(spec: TrainerSpec) -> str | None:
    """``data.path``'s ``.idx``/``.bin`` pair missing on this machine (``marind submit`` checks it).

    Returns:
        One line naming the missing file and the fix, or None.
    """
    for suffix in (".idx", ".bin"):
        path = spec.data.path + suffix
        if not os.path.isfile(path):
            return (f"data.path: dataset {path} does not exist; prepare it (`marind data prepare ... -o "
                    f"{spec.data.path}`), or fix data.path (relative to job.working_dir {spec.job.working_dir})")
    return None


def init_from_problem(spec: TrainerSpec) -> str | None:
    """What keeps ``model.init_from`` from starting this run (``marind submit`` checks it).

    The directory must exist with a Llama ``config.json`` whose shape matches ``[model]``
    and safetensors weights (``model.safetensors`` or ``model.safetensors.index.json``).

    Returns:
        One line naming the problem and the fix, or None (also when ``init_from`` is unset).
    """
    from marind.trainer.hf.mapping import config_mismatch, model_config_from_hf

    path = spec.model.init_from
    if not path:
        return None
    where = f"model.init_from: {path}"
    config = Path(path) / "config.json"
    if not Path(path).is_dir():
        return f"{where} is not a directory; pass a Hugging Face model directory (marind ckpt export --format hf)"
    if not ((Path(path) / "model.safetensors").is_file() or (Path(path) / "model.safetensors.index.json").is_file()):
        return f"{where} has no model.safetensors or model.safetensors.index.json; export safetensors weights there"
    try:
        hf_model = model_config_from_hf(json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{where}: cannot use {config} ({exc}); point init_from at a Llama model directory"
    mismatch = config_mismatch(dataclasses.asdict(spec.model), hf_model)
    return f"{where}: {mismatch}" if mismatch else None


def _resolve_model(model: ModelSpec, given: set[str]) -> ModelSpec:
    """Fill the dims the user did not set from the preset."""
    if model.preset == "custom":
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in given]
        if missing:
            raise SpecError(f"model.preset = \"custom\" needs model.{missing[0]}; set it or pick a preset")
        dim, n_layers, n_heads = model.dim, model.n_layers, model.n_heads
    elif model.preset in PRESETS:
        dim, n_layers, n_heads = PRESETS[model.preset]
    elif model.preset in MOE_PRESETS:
        dim, n_layers, n_heads = preset_dims(model.preset)
    else:
        raise SpecError(f"model.preset = {model.preset!r} is unknown"
                        f"{did_you_mean(model.preset, [*PRESETS, *MOE_PRESETS, 'custom'])}")
    dim = model.dim if "dim" in given else dim
    n_layers = model.n_layers if "n_layers" in given else n_layers
    n_heads = model.n_heads if "n_heads" in given else n_heads
    ffn_dim = model.ffn_dim if "ffn_dim" in given else swiglu_hidden(dim)
    return resolve_moe(dataclasses.replace(model, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim),
                       given)


# ---------------------------------------------------------------- validation

def validate_trainer_spec(spec: TrainerSpec, *, check_worlds: bool = True) -> None:
    """Everything about the trainer's sections that can be checked without a world size, then
    (``check_worlds``) the mesh and batch arithmetic at every world size the job may run at.

    Raises:
        SpecError: the first problem, in one line.
    """
    m, p, d, o, t = spec.model, spec.parallel, spec.data, spec.optim, spec.train
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        positive(getattr(m, key), f"model.{key}")
    if m.vocab_size is not None:
        positive(m.vocab_size, "model.vocab_size")
    positive(m.norm_eps, "model.norm_eps")
    if m.dim % m.n_heads:
        raise SpecError(f"model.n_heads = {m.n_heads} must divide model.dim = {m.dim}")
    if (m.dim // m.n_heads) % 2:
        raise SpecError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (rotary embeddings)")
    if p.dp_replicate == 0 or p.dp_replicate < -1:
        raise SpecError(f"parallel.dp_replicate must be >= 1, or -1 to fill the world, got {p.dp_replicate}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise SpecError(f"parallel.dp_shard must be >= 1, or -1 to fill the world, got {p.dp_shard}")
    if p.dp_replicate == -1 and p.dp_shard == -1:
        raise SpecError("parallel.dp_replicate and parallel.dp_shard are both -1; fix one of them "
                        "(e.g. dp_shard = GPUs per node for HSDP)")
    if p.tp < 1:
        raise SpecError(f"parallel.tp must be >= 1, got {p.tp}")
    if m.n_heads % p.tp:
        raise SpecError(f"parallel.tp = {p.tp} must divide model.n_heads = {m.n_heads}; pick a divisor of {m.n_heads}")
    if m.ffn_dim % p.tp:
        raise SpecError(f"parallel.tp = {p.tp} must divide model.ffn_dim = {m.ffn_dim}")
    validate_moe(m, p)
    if p.mixed_precision not in ("fp32", "bf16"):
        raise SpecError(f"parallel.mixed_precision = {p.mixed_precision!r}: use \"fp32\" or \"bf16\"")
    for key in ("seq_len", "global_batch", "micro_batch"):
        positive(getattr(d, key), f"data.{key}")
    if d.global_batch % d.micro_batch:
        raise SpecError(f"data.global_batch = {d.global_batch} is not divisible by data.micro_batch = "
                        f"{d.micro_batch}; make it a multiple")
    positive(o.lr, "optim.lr")
    positive(o.min_lr, "optim.min_lr", zero_ok=True)
    if o.min_lr > o.lr:
        raise SpecError(f"optim.min_lr = {o.min_lr} must not exceed optim.lr = {o.lr}")
    positive(o.warmup_steps, "optim.warmup_steps", zero_ok=True)
    positive(o.weight_decay, "optim.weight_decay", zero_ok=True)
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise SpecError(f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    positive(o.eps, "optim.eps")
    positive(o.grad_clip, "optim.grad_clip", zero_ok=True)
    positive(t.steps, "train.steps")
    positive(t.log_every, "train.log_every")
    positive(t.max_bad_steps, "train.max_bad_steps")
    validate_pipeline(spec)
    if check_worlds:
        j = spec.job
        for world in spec.world_sizes():
            nodes = world // j.nproc_per_node
            try:
                validate_for_world(spec, world)
            except SpecError as exc:
                raise SpecError(f"{exc} (at {nodes} node(s) x {j.nproc_per_node} procs of "
                                f"job.nodes = \"{j.nodes[0]}:{j.nodes[1]}\")") from None


def resolve_mesh(spec: TrainerSpec, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) for ``world_size`` (of one pipeline stage: ``world_size / pp``);
    the one size set to -1 fills the rest.

    Raises:
        SpecError: the mesh does not fit ``world_size``.
    """
    p = spec.parallel
    if world_size < 1:
        raise SpecError(f"world size must be >= 1, got {world_size}")
    world = f"the world size {world_size}" if p.pp == 1 else \
        f"the world size {world_size} / parallel.pp = {p.pp} = {world_size // max(p.pp, 1)}"
    world_size = pipeline_world(spec, world_size)   # the ranks of one pipeline stage (all of them when pp = 1)
    if p.dp_replicate == -1:
        fixed = p.dp_shard * p.tp
        if world_size % fixed:
            raise SpecError(f"parallel.dp_shard x parallel.tp = {fixed} does not divide "
                            f"{world}; change them or the number of processes")
        return world_size // fixed, p.dp_shard, p.tp
    fixed = p.dp_replicate * p.tp
    if p.dp_shard == -1:
        if world_size % fixed:
            raise SpecError(f"parallel.dp_replicate x parallel.tp = {fixed} does not divide "
                            f"{world}; change them or the number of processes")
        return p.dp_replicate, world_size // fixed, p.tp
    if fixed * p.dp_shard != world_size:
        raise SpecError(f"parallel mesh dp_replicate x dp_shard x tp = {p.dp_replicate}x{p.dp_shard}x{p.tp} = "
                        f"{fixed * p.dp_shard} does not match {world}; "
                        f"set parallel.dp_shard = -1 to fill it")
    return p.dp_replicate, p.dp_shard, p.tp


def grad_accum_steps(spec: TrainerSpec, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step: global_batch / (micro_batch x dp).

    Raises:
        SpecError: ``global_batch`` does not divide by ``micro_batch x dp``.
    """
    d = spec.data
    per_step = d.micro_batch * dp_size
    if d.global_batch % per_step:
        raise SpecError(f"data.global_batch = {d.global_batch} is not divisible by data.micro_batch x dp = "
                        f"{d.micro_batch}x{dp_size} = {per_step}; pick a global_batch that is a multiple of it")
    return d.global_batch // per_step


def validate_for_world(spec: TrainerSpec, world_size: int) -> tuple[int, int, int]:
    """Check the mesh and batch arithmetic for ``world_size``; returns the mesh sizes.

    Raises:
        SpecError: the mesh or the batch arithmetic does not fit ``world_size``.
    """
    mesh = resolve_mesh(spec, world_size)
    validate_ep_for_world(spec.parallel.ep, mesh[1])
    check_microbatch_split(spec, grad_accum_steps(spec, mesh[0] * mesh[1]))
    return mesh

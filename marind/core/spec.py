"""The run spec: ``run.toml`` parsed into frozen dataclasses (docs/design.md §3).

One loader for everybody: ``marind submit`` validates with it before
anything reaches etcd, and the trainer reads its job's spec through it.

* ``load_spec(path_or_text)`` parses and validates; every problem is a
  ``SpecError`` with one line naming the key path and the fix (TOML syntax
  errors carry the line, unknown keys a did-you-mean).
* ``RunSpec.to_dict()`` / ``RunSpec.from_dict(d)`` round-trip through
  JSON (durations become seconds, ``nodes`` stays ``"min:max"``).
* ``resolve_mesh(spec, world_size)`` gives ``(dp_replicate, dp_shard, tp)``
  for a world size; ``validate_for_world`` checks the batch arithmetic.
  Without a world size, ``load_spec`` checks every world size the job can
  run at (each node count in ``job.nodes`` x ``job.nproc_per_node``).

Field kinds, durations, node ranges and did-you-mean come from the schema
engine in ``marind.core.schema`` (the agent's config reads with it too).

Model presets live here (not in the trainer) because validation needs the
head count: ``tp`` must divide ``n_heads`` and the MLP width.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marind.core.errors import SpecError
from marind.core.schema import did_you_mean, load_toml, parse_table, spec_field, table_of
from marind.core.schema import parse_duration as parse_duration  # re-exported: part of the spec's API
from marind.core.schema import parse_nodes as parse_nodes  # re-exported: part of the spec's API

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

#: The reference trainer's module. ``entrypoint = "trainer"`` (its name before it moved
#: into the marind package) still means it.
TRAINER_ENTRYPOINT = "marind.trainer"
_ENTRYPOINT_ALIASES = {"trainer": TRAINER_ENTRYPOINT}

@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str = spec_field("job", "str")
    nodes: tuple[int, int] = spec_field((1, 1), "nodes")
    nproc_per_node: int = spec_field(1, "int")
    max_restarts: int = spec_field(3, "int")
    hang_timeout: float = spec_field(300.0, "duration")
    entrypoint: str = spec_field(TRAINER_ENTRYPOINT, "str")
    warm_start: bool = spec_field(True, "bool")       # fork workers from a zygote with torch loaded (marind/zygote.py)
    env: tuple[tuple[str, str], ...] = spec_field((), "env")


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


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    dp_replicate: int = spec_field(1, "int")
    dp_shard: int = spec_field(-1, "int")
    tp: int = spec_field(1, "int")
    mixed_precision: str = spec_field("fp32", "str")        # "fp32" | "bf16"
    activation_checkpointing: bool = spec_field(False, "bool")
    compile: bool = spec_field(False, "bool")


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
    tensorboard_dir: str = spec_field("", "str")  # "" = off (also off when tensorboard is missing)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    url: str = spec_field("", "str")              # "" = no checkpoints
    every_steps: int = spec_field(20, "int")      # 0 = off
    every_seconds: float | None = spec_field(None, "duration?")
    async_: bool = spec_field(True, "bool", key="async")
    keep_last: int = spec_field(3, "int")         # 0 = keep all
    keep_every: int = spec_field(0, "int")        # also keep every step divisible by this, for good; 0 = off
    wait_timeout: float = spec_field(600.0, "duration")


FAULT_MODES = ("elastic", "torchft")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Fault-tolerance mode, and fault injection for tests (the trainer honours ``nan_at_step``).

    ``mode = "elastic"`` (default): torch elastic restarts every worker on a failure.
    ``mode = "torchft"``: every ``nodes_per_group`` nodes form one replica group (one torchrun
    rendezvous; FSDP/TP inside), data parallel across groups through torchft; a failed group heals
    from a live peer while the others keep stepping (trainer/ft.py). ``data.global_batch`` is then
    per group and step.
    """

    nan_at_step: int = spec_field(0, "int")       # 0 = off; also env MARIND_TEST_NAN_AT_STEP
    mode: str = spec_field("elastic", "str")
    replica_groups: int = spec_field(2, "int")    # torchft: group slots
    nodes_per_group: int = spec_field(1, "int")   # torchft: nodes in one replica group (one torch world)
    min_replicas: int = spec_field(1, "int")      # torchft: groups needed to commit a step
    timeout: float = spec_field(30.0, "duration")           # torchft: collectives, commit, state transfer
    quorum_timeout: float = spec_field(60.0, "duration")    # torchft: waiting for a quorum
    join_timeout: float = spec_field(1.0, "duration")       # lighthouse: wait for stragglers before a quorum
    heartbeat_timeout: float = spec_field(5.0, "duration")  # lighthouse: a silent group is dead after this


_SECTIONS: dict[str, type] = {
    "job": JobSpec, "model": ModelSpec, "parallel": ParallelSpec, "data": DataSpec,
    "optim": OptimSpec, "train": TrainSpec, "checkpoint": CheckpointSpec, "fault": FaultSpec,
}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
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
        return {name: table_of(getattr(self, name)) for name in _SECTIONS}

    @classmethod
    def from_dict(cls, data: Mapping, *, check_worlds: bool = True) -> RunSpec:
        return _build(data, source="spec", check_worlds=check_worlds)

    def world_sizes(self) -> list[int]:
        """Every world size this job may run at (node counts x procs per node).

        Under ``fault.mode = "torchft"`` a torch world is one replica group: ``nodes_per_group`` nodes.
        """
        if self.fault.mode == "torchft":
            return [self.fault.nodes_per_group * self.job.nproc_per_node]
        lo, hi = self.job.nodes
        return [n * self.job.nproc_per_node for n in range(lo, hi + 1)]

    def replace(self, **sections) -> RunSpec:
        return dataclasses.replace(self, **sections)


# ---------------------------------------------------------------- loading

def load_spec(src: str | os.PathLike, *, check_worlds: bool = True) -> RunSpec:
    """Parse and validate a run spec from a file path or from TOML text.

    A ``str`` without a newline that names an existing file (or ends in
    ``.toml``) is a path; any other ``str`` is TOML text.
    """
    if isinstance(src, os.PathLike) or (isinstance(src, str) and "\n" not in src
                                        and (src.endswith(".toml") or os.path.isfile(src))):
        path = Path(src)
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(f"cannot read run spec {path}: {exc.strerror or exc}; check the path") from exc
        source = str(path)
    else:
        text, source = str(src), "run.toml"
    data = load_toml(text, source, fix="; fix the syntax at that line")
    return _build(data, source=source, check_worlds=check_worlds)


def _build(data: Mapping, *, source: str, check_worlds: bool) -> RunSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"{source}: a run spec must be a table of sections")
    sections: dict[str, Any] = {}
    given_model: set[str] = set()
    for name, raw in data.items():
        if name not in _SECTIONS:
            raise SpecError(f"unknown section [{name}]{did_you_mean(name, _SECTIONS)}; remove or rename it")
        sections[name], given = parse_table(_SECTIONS[name], raw, name)
        if name == "model":
            given_model = given
    if "data" not in sections or not sections["data"].path:
        raise SpecError("data.path is required: the prefix of a prepared .bin/.idx pair "
                        "(make one with `marind data prepare`)")
    sections["model"] = _resolve_model(sections.get("model", ModelSpec()), given_model)
    job = sections.get("job", JobSpec())
    if job.entrypoint in _ENTRYPOINT_ALIASES:
        sections["job"] = dataclasses.replace(job, entrypoint=_ENTRYPOINT_ALIASES[job.entrypoint])
    spec = RunSpec(**sections)
    validate_spec(spec, check_worlds=check_worlds)
    return spec


def _resolve_model(model: ModelSpec, given: set[str]) -> ModelSpec:
    """Fill the dims the user did not set from the preset."""
    if model.preset == "custom":
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in given]
        if missing:
            raise SpecError(f"model.preset = \"custom\" needs model.{missing[0]}; set it or pick a preset")
        dim, n_layers, n_heads = model.dim, model.n_layers, model.n_heads
    elif model.preset in PRESETS:
        dim, n_layers, n_heads = PRESETS[model.preset]
    else:
        raise SpecError(f"model.preset = {model.preset!r} is unknown"
                        f"{did_you_mean(model.preset, [*PRESETS, 'custom'])}")
    dim = model.dim if "dim" in given else dim
    n_layers = model.n_layers if "n_layers" in given else n_layers
    n_heads = model.n_heads if "n_heads" in given else n_heads
    ffn_dim = model.ffn_dim if "ffn_dim" in given else swiglu_hidden(dim)
    return dataclasses.replace(model, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim)


# ---------------------------------------------------------------- validation

def _positive(value: int | float, path: str, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise SpecError(f"{path} must be {bound}, got {value!r}")


def validate_spec(spec: RunSpec, *, check_worlds: bool = True) -> None:
    """Everything that can be checked without knowing the world size."""
    j, m, p, d, o, t, c = (spec.job, spec.model, spec.parallel, spec.data, spec.optim,
                           spec.train, spec.checkpoint)
    if not j.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", j.name):
        raise SpecError(f"job.name = {j.name!r}: use 1-63 letters, digits, '.', '_' or '-'")
    _positive(j.nproc_per_node, "job.nproc_per_node")
    _positive(j.max_restarts, "job.max_restarts", zero_ok=True)
    _positive(j.hang_timeout, "job.hang_timeout")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", j.entrypoint):
        raise SpecError(f"job.entrypoint = {j.entrypoint!r} must be a python module name like \"marind.trainer\"")
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        _positive(getattr(m, key), f"model.{key}")
    if m.vocab_size is not None:
        _positive(m.vocab_size, "model.vocab_size")
    _positive(m.norm_eps, "model.norm_eps")
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
    if p.mixed_precision not in ("fp32", "bf16"):
        raise SpecError(f"parallel.mixed_precision = {p.mixed_precision!r}: use \"fp32\" or \"bf16\"")
    for key in ("seq_len", "global_batch", "micro_batch"):
        _positive(getattr(d, key), f"data.{key}")
    if d.global_batch % d.micro_batch:
        raise SpecError(f"data.global_batch = {d.global_batch} is not divisible by data.micro_batch = "
                        f"{d.micro_batch}; make it a multiple")
    _positive(o.lr, "optim.lr")
    _positive(o.min_lr, "optim.min_lr", zero_ok=True)
    if o.min_lr > o.lr:
        raise SpecError(f"optim.min_lr = {o.min_lr} must not exceed optim.lr = {o.lr}")
    _positive(o.warmup_steps, "optim.warmup_steps", zero_ok=True)
    _positive(o.weight_decay, "optim.weight_decay", zero_ok=True)
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise SpecError(f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    _positive(o.eps, "optim.eps")
    _positive(o.grad_clip, "optim.grad_clip", zero_ok=True)
    _positive(t.steps, "train.steps")
    _positive(t.log_every, "train.log_every")
    _positive(t.max_bad_steps, "train.max_bad_steps")
    _positive(c.every_steps, "checkpoint.every_steps", zero_ok=True)
    if c.every_seconds is not None:
        _positive(c.every_seconds, "checkpoint.every_seconds")
    _positive(c.keep_last, "checkpoint.keep_last", zero_ok=True)
    _positive(c.keep_every, "checkpoint.keep_every", zero_ok=True)
    _positive(spec.fault.nan_at_step, "fault.nan_at_step", zero_ok=True)
    _validate_fault(spec)
    if check_worlds:
        for world in spec.world_sizes():
            nodes = world // j.nproc_per_node
            try:
                validate_for_world(spec, world)
            except SpecError as exc:
                raise SpecError(f"{exc} (at {nodes} node(s) x {j.nproc_per_node} procs of "
                                f"job.nodes = \"{j.nodes[0]}:{j.nodes[1]}\")") from None


def _validate_fault(spec: RunSpec) -> None:
    f = spec.fault
    if f.mode not in FAULT_MODES:
        raise SpecError(f"fault.mode = {f.mode!r}{did_you_mean(f.mode, FAULT_MODES)}")
    if f.mode != "torchft":
        return
    _positive(f.replica_groups, "fault.replica_groups")
    _positive(f.min_replicas, "fault.min_replicas")
    _positive(f.nodes_per_group, "fault.nodes_per_group")
    if f.min_replicas > f.replica_groups:
        raise SpecError(f"fault.min_replicas = {f.min_replicas} exceeds fault.replica_groups = "
                        f"{f.replica_groups}; lower it")
    most = f.replica_groups * f.nodes_per_group
    if spec.job.nodes[1] > most:
        raise SpecError(f"job.nodes = \"{spec.job.nodes[0]}:{spec.job.nodes[1]}\": under fault.mode = \"torchft\" "
                        f"at most fault.replica_groups x fault.nodes_per_group = {most} nodes take part; "
                        f"lower job.nodes or raise fault.replica_groups")
    for key in ("timeout", "quorum_timeout", "join_timeout", "heartbeat_timeout"):
        _positive(getattr(f, key), f"fault.{key}")


def resolve_mesh(spec: RunSpec, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) for ``world_size``; the one size set to -1 fills the rest."""
    p = spec.parallel
    if world_size < 1:
        raise SpecError(f"world size must be >= 1, got {world_size}")
    if p.dp_replicate == -1:
        fixed = p.dp_shard * p.tp
        if world_size % fixed:
            raise SpecError(f"parallel.dp_shard x parallel.tp = {fixed} does not divide the world size "
                            f"{world_size}; change them or the number of processes")
        return world_size // fixed, p.dp_shard, p.tp
    fixed = p.dp_replicate * p.tp
    if p.dp_shard == -1:
        if world_size % fixed:
            raise SpecError(f"parallel.dp_replicate x parallel.tp = {fixed} does not divide the world size "
                            f"{world_size}; change them or the number of processes")
        return p.dp_replicate, world_size // fixed, p.tp
    if fixed * p.dp_shard != world_size:
        raise SpecError(f"parallel mesh dp_replicate x dp_shard x tp = {p.dp_replicate}x{p.dp_shard}x{p.tp} = "
                        f"{fixed * p.dp_shard} does not match the world size {world_size}; "
                        f"set parallel.dp_shard = -1 to fill it")
    return p.dp_replicate, p.dp_shard, p.tp


def grad_accum_steps(spec: RunSpec, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step: global_batch / (micro_batch x dp)."""
    d = spec.data
    per_step = d.micro_batch * dp_size
    if d.global_batch % per_step:
        raise SpecError(f"data.global_batch = {d.global_batch} is not divisible by data.micro_batch x dp = "
                        f"{d.micro_batch}x{dp_size} = {per_step}; pick a global_batch that is a multiple of it")
    return d.global_batch // per_step


def validate_for_world(spec: RunSpec, world_size: int) -> tuple[int, int, int]:
    """Check the mesh and batch arithmetic for ``world_size``; returns the mesh sizes."""
    mesh = resolve_mesh(spec, world_size)
    grad_accum_steps(spec, mesh[0] * mesh[1])
    return mesh

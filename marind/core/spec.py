"""The run spec: ``run.toml`` parsed into frozen dataclasses (docs/design.md §3).

One loader for everybody: ``marind submit`` validates with it before
anything reaches etcd, the agent reads the stored spec with it, and a
program reads its own sections from the stored run.toml.

* ``load_spec(path_or_text)`` parses and validates marind's own sections:
  ``[job]`` (what runs, where, how many), ``[checkpoint]`` and ``[fault]``.
  Every other section is kept raw (``RunSpec.sections``): the program's
  own config, passed through untouched. Every problem is a ``SpecError``
  with one line naming the key path and the fix.
* ``[job]`` runs either ``entrypoint = "pkg.module"`` (``python -m``) or
  ``command = ["python", "train.py", ...]`` (any executable), never both;
  neither means the reference trainer (``marind.trainer``).
* ``resolve_paths(spec, base_dir)``: ``job.working_dir`` (default: the
  run.toml's directory) becomes absolute, and a local ``checkpoint.url``
  resolves against it. ``load_spec`` of a file does this against the
  file's directory; ``marind submit`` stores the result.
* ``RunSpec.to_dict()`` / ``RunSpec.from_dict(d)`` round-trip through
  JSON (durations become seconds, ``nodes`` stays ``"min:max"``).

The reference trainer's sections (``model parallel data optim train``),
its presets and its batch arithmetic live in ``marind.trainer.config``;
this module knows the trainer only by its module name.

Field kinds, durations, node ranges and did-you-mean come from the schema
engine in ``marind.core.schema`` (the agent's config reads with it too).
"""

from __future__ import annotations

import dataclasses
import datetime
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

#: The reference trainer's module. ``entrypoint = "trainer"`` (its name before it moved
#: into the marind package) still means it.
TRAINER_ENTRYPOINT = "marind.trainer"
_ENTRYPOINT_ALIASES = {"trainer": TRAINER_ENTRYPOINT}
_MODULE_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str = spec_field("job", "str")
    nodes: tuple[int, int] = spec_field((1, 1), "nodes")
    nproc_per_node: int = spec_field(1, "int")
    max_restarts: int = spec_field(3, "int")
    hang_timeout: float = spec_field(300.0, "duration")
    entrypoint: str = spec_field(TRAINER_ENTRYPOINT, "str")   # "" when ``command`` runs instead
    command: tuple[str, ...] = spec_field((), "strs")         # any executable and its arguments
    working_dir: str = spec_field("", "str")      # the workers' cwd; "" = the run.toml's dir at submit
    preload: tuple[str, ...] = spec_field((), "strs")         # modules the zygote imports (besides torch)
    warm_start: bool = spec_field(True, "bool")       # fork workers from a zygote with torch loaded (marind/agent/warm_start/zygote.py)
    env: tuple[tuple[str, str], ...] = spec_field((), "env")
    tensorboard_dir: str = spec_field("", "str")  # the agent's TensorBoard files; "" = {run dir}/tensorboard
    wandb: tuple[tuple[str, str], ...] = spec_field((), "env")  # { project = "..." }: a W&B run (() = none)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    url: str = spec_field("", "str")              # "" = no checkpoints
    every_steps: int = spec_field(20, "int")      # 0 = off
    every_seconds: float | None = spec_field(None, "duration?")
    async_: bool = spec_field(True, "bool", key="async")
    keep_last: int = spec_field(3, "int")         # 0 = keep all
    keep_every: int = spec_field(0, "int")        # also keep every step divisible by this, for good; 0 = off
    wait_timeout: float = spec_field(600.0, "duration")
    prepare_timeout: float = spec_field(2.0, "duration")   # under an agent: an async save's storage check; 0 = unbounded
    on_stop: bool = spec_field(True, "bool")      # a stop (SIGTERM: cancel, resize, drain) saves the step reached
    memory_every: int = spec_field(0, "int")      # memory checkpoints (host memory + a peer's replica) every N steps; 0 = off
    memory_dir: str = spec_field("/dev/shm/marind-ckpt", "str")   # each host's directory of them (a tmpfs)


FAULT_MODES = ("elastic", "torchft")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """Fault-tolerance mode, and fault injection for tests (the trainer honours ``nan_at_step``).

    ``mode = "elastic"`` (default): torch elastic restarts every worker on a failure.
    ``mode = "torchft"``: every ``nodes_per_group`` nodes form one replica group (one torchrun
    rendezvous; FSDP/TP inside), data parallel across groups through torchft; a failed group heals
    from a live peer while the others keep stepping (trainer/ft/train.py). ``data.global_batch`` is then
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
    drift_check_every: int = spec_field(100, "int")  # torchft: compare the groups' state every N steps (0 = off)
    straggler_factor: float = spec_field(1.5, "float")      # a rank this much slower than the median is named
    straggler_window: float = spec_field(30.0, "duration")  # ... when it stayed so over this window
    straggler_action: str = spec_field("none", "str")       # "exclude": also take the straggler's node out


#: marind's own sections; every other one is the program's (``RunSpec.sections``).
CORE_SECTIONS: dict[str, type] = {"job": JobSpec, "checkpoint": CheckpointSpec, "fault": FaultSpec}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """A job's spec: marind's sections typed, the program's own sections raw (never mutate them)."""

    job: JobSpec = field(default_factory=JobSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    fault: FaultSpec = field(default_factory=FaultSpec)
    sections: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-able form with the TOML key names; ``from_dict`` reads it back."""
        out: dict[str, Any] = {name: section_table(getattr(self, name)) for name in CORE_SECTIONS}
        out.update(self.sections)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> RunSpec:
        """A spec from its ``to_dict`` form (or parsed TOML): validated, paths left as they are.

        Raises:
            SpecError: the spec is not valid.
        """
        return _build(data, source="spec")

    @property
    def runs_trainer(self) -> bool:
        """Does this job run the reference trainer (whose sections ``marind.trainer.config`` checks)?"""
        return not self.job.command and self.job.entrypoint == TRAINER_ENTRYPOINT

    def section(self, name: str) -> dict[str, Any]:
        """A program's own section, raw (``{}`` when the spec has none)."""
        value = self.sections.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def target_steps(self) -> int | None:
        """``train.steps`` when the spec sets it (the trainer's always does): where the job ends."""
        steps = self.section("train").get("steps")
        return steps if isinstance(steps, int) and not isinstance(steps, bool) else None

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


#: Keys of ``[job] wandb`` (strings; ``project`` required) and its modes (``auto``: online with an API key).
WANDB_KEYS = ("project", "entity", "name", "group", "mode")
WANDB_MODES = ("auto", "online", "offline")


def tensorboard_dir(spec: RunSpec, run_dir: str | os.PathLike | None) -> str:
    """Where the agent writes the job's TensorBoard files: ``[job] tensorboard_dir``, else the
    reference trainer's older name for it (``train.tensorboard_dir``), else ``{run_dir}/tensorboard``
    ("" when ``run_dir`` is None). A relative path is taken from ``[job] working_dir``."""
    path = spec.job.tensorboard_dir or spec.section("train").get("tensorboard_dir") or ""
    if not isinstance(path, str) or not path:
        return str(Path(run_dir) / "tensorboard") if run_dir is not None else ""
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) or not spec.job.working_dir else str(Path(spec.job.working_dir) / path)


def section_table(section: Any) -> dict[str, Any]:
    """A typed section as its TOML table; ``[job]`` keeps only the one of entrypoint/command it runs."""
    table = table_of(section)
    if isinstance(section, JobSpec):
        table.pop("command" if not section.command else "entrypoint")
    return table


# ---------------------------------------------------------------- loading

def load_spec(src: str | os.PathLike, *, base_dir: str | os.PathLike | None = None) -> RunSpec:
    """Parse and validate a run spec from a file path or from TOML text.

    A ``str`` without a newline that names an existing file (or ends in
    ``.toml``) is a path; any other ``str`` is TOML text.

    Args:
        src: the run.toml's path, or its text.
        base_dir: what relative paths resolve against (``resolve_paths``); default: the
            file's directory, and for text nothing is resolved.

    Returns:
        The spec.

    Raises:
        SpecError: unreadable file, bad TOML, or an invalid spec (one line).
    """
    if isinstance(src, os.PathLike) or (isinstance(src, str) and "\n" not in src
                                        and (src.endswith(".toml") or os.path.isfile(src))):
        path = Path(src)
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(f"cannot read run spec {path}: {exc.strerror or exc}; check the path") from exc
        source = str(path)
        base_dir = path.resolve().parent if base_dir is None else base_dir
    else:
        text, source = str(src), "run.toml"
    data = load_toml(text, source, fix="; fix the syntax at that line")
    spec = _build(data, source=source)
    return resolve_paths(spec, base_dir) if base_dir is not None else spec


def _build(data: Mapping, *, source: str) -> RunSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"{source}: a run spec must be a table of sections")
    typed: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    given_job: set[str] = set()
    for name, value in data.items():
        if name in CORE_SECTIONS:
            typed[name], given = parse_table(CORE_SECTIONS[name], value, name)
            if name == "job":
                given_job = given
        else:
            _check_plain(value, name)
            raw[name] = value
    typed["job"] = _resolve_program(typed.get("job", JobSpec()), given_job)
    spec = RunSpec(**typed, sections=raw)
    validate_spec(spec)
    return spec


def _resolve_program(job: JobSpec, given: set[str]) -> JobSpec:
    """Exactly one of ``entrypoint`` and ``command``; neither means the reference trainer."""
    entrypoint = job.entrypoint if "entrypoint" in given else ""
    if job.command:
        if entrypoint:
            raise SpecError("[job] sets both entrypoint and command; keep one (entrypoint = \"pkg.module\" "
                            "runs `python -m pkg.module run.toml`, command = [...] runs any program)")
        return dataclasses.replace(job, entrypoint="")
    if "command" in given:
        raise SpecError("job.command is empty; name the program, e.g. command = [\"python\", \"train.py\"]")
    if "entrypoint" in given and not entrypoint:
        raise SpecError("job.entrypoint is empty; name a module (\"marind.trainer\") or set job.command instead")
    entrypoint = entrypoint or TRAINER_ENTRYPOINT
    return dataclasses.replace(job, entrypoint=_ENTRYPOINT_ALIASES.get(entrypoint, entrypoint))


def _check_plain(value: Any, path: str) -> None:
    """A program's section must survive JSON (etcd) and TOML (the stored run.toml) unchanged."""
    if isinstance(value, (datetime.date, datetime.time)):
        raise SpecError(f"{path} is a TOML date/time, which a stored spec cannot hold; write it as a string")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]")


def _is_local_path(url: str) -> bool:
    return bool(url) and "://" not in url


def resolve_paths(spec: RunSpec, base_dir: str | os.PathLike) -> RunSpec:
    """Relative paths of marind's sections made absolute, as ``marind submit`` stores them.

    ``job.working_dir`` resolves against ``base_dir`` ("" is ``base_dir`` itself); a
    ``checkpoint.url`` that is a local path (no ``scheme://``) resolves against the working dir.
    A program's own sections are left alone: its workers run in the working dir.

    Args:
        spec: the spec as parsed.
        base_dir: the run.toml's directory (``marind submit``).

    Returns:
        The spec with absolute paths.
    """
    base = Path(base_dir).expanduser().resolve()
    working = (base / Path(spec.job.working_dir).expanduser()).resolve() if spec.job.working_dir else base
    url = spec.checkpoint.url
    if _is_local_path(url) and not os.path.isabs(os.path.expanduser(url)):
        url = str(working / url)
    return spec.replace(job=dataclasses.replace(spec.job, working_dir=str(working)),
                        checkpoint=dataclasses.replace(spec.checkpoint, url=url))


def missing_paths(spec: RunSpec) -> str | None:
    """What ``marind submit`` can see is missing on this machine (the working dir), if anything.

    Returns:
        One line naming the path and the fix, or None.
    """
    wd = spec.job.working_dir
    if wd and not os.path.isdir(wd):
        return (f"job.working_dir {wd} is not a directory; create it, or set [job] working_dir "
                f"(relative to the run.toml's directory)")
    return None


# ---------------------------------------------------------------- validation

def positive(value: int | float, path: str, zero_ok: bool = False) -> None:
    """Raise ``SpecError`` naming ``path`` unless ``value > 0`` (``>= 0`` with ``zero_ok``)."""
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise SpecError(f"{path} must be {bound}, got {value!r}")


def validate_spec(spec: RunSpec) -> None:
    """Check marind's sections (the program's own are the program's to check).

    Raises:
        SpecError: the first problem, in one line.
    """
    j, c = spec.job, spec.checkpoint
    if not j.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", j.name):
        raise SpecError(f"job.name = {j.name!r}: use 1-63 letters, digits, '.', '_' or '-'")
    positive(j.nproc_per_node, "job.nproc_per_node")
    positive(j.max_restarts, "job.max_restarts", zero_ok=True)
    positive(j.hang_timeout, "job.hang_timeout")
    if j.entrypoint and (not _MODULE_RE.fullmatch(j.entrypoint) or j.entrypoint.endswith(".py")):
        hint = (f"; to run a script use command = [\"python\", {j.entrypoint!r}]"
                if j.entrypoint.endswith(".py") or "/" in j.entrypoint else "")
        raise SpecError(f"job.entrypoint = {j.entrypoint!r} must be a python module name like "
                        f"\"marind.trainer\"{hint}")
    if any(not word for word in j.command):
        raise SpecError(f"job.command = {list(j.command)!r} has an empty string; remove it")
    for module in j.preload:
        if not _MODULE_RE.fullmatch(module):
            raise SpecError(f"job.preload: {module!r} is not a python module name like \"pkg.module\"")
    _validate_wandb(dict(j.wandb))
    positive(c.every_steps, "checkpoint.every_steps", zero_ok=True)
    if c.every_seconds is not None:
        positive(c.every_seconds, "checkpoint.every_seconds")
    positive(c.keep_last, "checkpoint.keep_last", zero_ok=True)
    positive(c.keep_every, "checkpoint.keep_every", zero_ok=True)
    positive(c.prepare_timeout, "checkpoint.prepare_timeout", zero_ok=True)
    positive(c.memory_every, "checkpoint.memory_every", zero_ok=True)
    if c.memory_every and not c.url:
        raise SpecError("checkpoint.memory_every needs checkpoint.url (the durable store the memory tier sits "
                        "below); set checkpoint.url or memory_every = 0")
    if c.memory_every and not os.path.isabs(c.memory_dir):
        raise SpecError(f"checkpoint.memory_dir = {c.memory_dir!r}: use an absolute path on a tmpfs "
                        "(e.g. \"/dev/shm/marind-ckpt\")")
    positive(spec.fault.nan_at_step, "fault.nan_at_step", zero_ok=True)
    _validate_fault(spec)


def _validate_wandb(table: dict[str, str]) -> None:
    if not table:
        return
    for key in table:
        if key not in WANDB_KEYS:
            raise SpecError(f"unknown key 'job.wandb.{key}'{did_you_mean(key, WANDB_KEYS)}; remove or rename it")
    if not table.get("project"):
        raise SpecError("job.wandb needs a project: wandb = { project = \"my-project\" }")
    mode = table.get("mode", "auto")
    if mode not in WANDB_MODES:
        raise SpecError(f"job.wandb.mode = {mode!r}{did_you_mean(mode, WANDB_MODES)}")


def _validate_fault(spec: RunSpec) -> None:
    f = spec.fault
    if f.mode not in FAULT_MODES:
        raise SpecError(f"fault.mode = {f.mode!r}{did_you_mean(f.mode, FAULT_MODES)}")
    _validate_stragglers(f)
    if f.mode != "torchft":
        return
    positive(f.replica_groups, "fault.replica_groups")
    positive(f.min_replicas, "fault.min_replicas")
    positive(f.nodes_per_group, "fault.nodes_per_group")
    if f.min_replicas > f.replica_groups:
        raise SpecError(f"fault.min_replicas = {f.min_replicas} exceeds fault.replica_groups = "
                        f"{f.replica_groups}; lower it")
    most = f.replica_groups * f.nodes_per_group
    if spec.job.nodes[1] > most:
        raise SpecError(f"job.nodes = \"{spec.job.nodes[0]}:{spec.job.nodes[1]}\": under fault.mode = \"torchft\" "
                        f"at most fault.replica_groups x fault.nodes_per_group = {most} nodes take part; "
                        f"lower job.nodes or raise fault.replica_groups")
    for key in ("timeout", "quorum_timeout", "join_timeout", "heartbeat_timeout"):
        positive(getattr(f, key), f"fault.{key}")


#: ``[fault] straggler_action``: name the stragglers only, or also take their node out of the job.
STRAGGLER_ACTIONS = ("none", "exclude")


def _validate_stragglers(f: FaultSpec) -> None:
    positive(f.drift_check_every, "fault.drift_check_every", zero_ok=True)
    if not f.straggler_factor > 1.0:
        raise SpecError(f"fault.straggler_factor = {f.straggler_factor:g}: a straggler is slower than the median "
                        "by this factor; use a number above 1 (e.g. 1.5)")
    positive(f.straggler_window, "fault.straggler_window")
    if f.straggler_action not in STRAGGLER_ACTIONS:
        raise SpecError(f"fault.straggler_action = {f.straggler_action!r}: use \"none\" (name stragglers) or "
                        "\"exclude\" (also restart the job without a straggler's node)")
    if f.straggler_action == "exclude" and f.mode != "elastic":
        raise SpecError("fault.straggler_action = \"exclude\" works in elastic mode only (a torchft group's "
                        "straggler is a replica group: leave it at \"none\")")

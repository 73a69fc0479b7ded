"""A TorchX ``AppDef`` as a marind run spec (docs/design.md §3): what ``torchx run -s marind`` stores.

marind runs one homogeneous elastic torchrun per job: one role, its replicas the job's nodes.

* ``role.num_replicas`` (and ``min_replicas``) -> ``job.nodes`` (``"min:max"``: marind's elastic range).
* A role that runs torchrun (``dist.ddp`` / ``dist.torchrun``: ``bash -c "torchrun ... train.py ARGS"``, or
  ``torchrun`` / ``python -m torch.distributed.run`` as the entrypoint) is unwrapped: its program becomes
  ``job.command`` (``["python", "train.py", ARGS]``, ``["python", "-m", MOD, ARGS]``, or the bare program
  with ``--no-python``), ``--nproc-per-node`` -> ``job.nproc_per_node``, ``--max-restarts`` ->
  ``job.max_restarts``. The rendezvous, log, tee/redirect, master address and signal options are
  dropped: marind's agent runs the torchrun with its own etcd rendezvous and logs.
* Any other role runs as ``job.command = [entrypoint, *args]`` on every node, one process per GPU of
  ``role.resource`` (one when it has none).
* ``role.env`` -> ``job.env``; macros: ``${app_id}`` is the marind job id, ``${img_root}`` the working
  dir, ``${rank0_env}`` ``MASTER_ADDR``, and ``${replica_id}`` ``$GROUP_RANK`` inside a shell command.
* ``role.max_retries`` -> ``job.max_restarts`` when > 0 (TorchX's default 0 means "not asked": marind's
  default applies; the ``max_restarts`` run option and torchrun's ``--max-restarts`` win).
* cpu and memMB, image, ports and metadata are not marind's to enforce: the job runs in the nodes' own
  environment and working dir, like TorchX's ``local_cwd``. Anything that cannot map (two roles, mounts,
  a workspace, shell steps around torchrun, a per-replica command) is one ``SpecError`` line.

The ``run_toml`` option names a base run.toml whose sections (``[checkpoint]``, ``[fault]``, the
program's own, ``[job]`` extras such as ``hang_timeout`` or ``preload``) the AppDef's keys go on top of.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchx.specs import AppDef, Role, macros

from marind.control.job_records import new_job_id
from marind.core.errors import SpecError
from marind.core.log import get_logger
from marind.core.schema import load_toml, parse_nodes
from marind.core.spec import RunSpec, missing_paths, resolve_paths

log = get_logger(__name__)

SHELLS = ("bash", "sh")
PYTHONS = ("python", "python3")
SHELL_OPERATORS = frozenset(";|&<>()") | {"&&", "||", ";;", ">>", "<<", "|&", "&>"}

#: torchrun's options (torch 2.13, ``torch.distributed.run.get_args_parser``) by destination, and whether
#: each takes a value; every option is spelled ``--a-b`` and ``--a_b`` (tests check the table against torch).
TORCHRUN_VALUE_OPTIONS = (
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
    "monitor_interval", "start_method", "event_log_handler", "role", "log_dir", "redirects", "tee",
    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank", "master_addr",
    "master_port", "local_addr", "logs_specs", "numa_binding", "signals_to_handle", "shutdown_timeout",
)
TORCHRUN_FLAG_OPTIONS = ("standalone", "module", "no_python", "run_path", "virtual_local_rank")
TORCHRUN_SHORT = {"-m": "module", "-r": "redirects", "-t": "tee"}
#: Options marind's agent sets on the torchrun it runs (rendezvous, logs, signals): dropped.
AGENT_OWNED = frozenset(TORCHRUN_VALUE_OPTIONS + TORCHRUN_FLAG_OPTIONS) - {
    "nnodes", "nproc_per_node", "max_restarts", "module", "no_python", "numa_binding", "virtual_local_rank"}
#: Options marind has no equivalent of: refused, with the reason.
UNMAPPABLE = {"numa_binding": "marind's agent does no NUMA binding (bind inside your program instead)",
              "virtual_local_rank": "marind's workers see their real LOCAL_RANK"}


def torchrun_options() -> dict[str, tuple[str, bool]]:
    """Every torchrun option string -> (destination, takes a value)."""
    table: dict[str, tuple[str, bool]] = {}
    for dests, takes_value in ((TORCHRUN_VALUE_OPTIONS, True), (TORCHRUN_FLAG_OPTIONS, False)):
        for dest in dests:
            for spelling in {f"--{dest}", f"--{dest.replace('_', '-')}"}:
                table[spelling] = (dest, takes_value)
    for short, dest in TORCHRUN_SHORT.items():
        table[short] = (dest, dest in TORCHRUN_VALUE_OPTIONS)
    return table


@dataclass(frozen=True)
class TorchrunCall:
    """A torchrun command line, as marind reads it."""

    options: dict[str, Any]
    program: list[str]


def parse_torchrun(words: list[str]) -> TorchrunCall:
    """torchrun's arguments (after ``torchrun``): its options and the program it runs.

    Raises:
        SpecError: an option torchrun does not have, one without its value, or no program.
    """
    table = torchrun_options()
    options: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        name, eq, value = word.partition("=")
        if name not in table and word[:2] in TORCHRUN_SHORT and TORCHRUN_SHORT[word[:2]] in TORCHRUN_VALUE_OPTIONS:
            name, eq, value = word[:2], "=", word[2:]          # -t3
        if name not in table:
            raise SpecError(f"torchrun option {name} is not one torchrun has; remove it from the component's command")
        dest, takes_value = table[name]
        if not takes_value:
            if eq:
                raise SpecError(f"torchrun option {name} takes no value; write {name} alone")
            options[dest] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(words):
                raise SpecError(f"torchrun option {name} has no value; give one ({name} VALUE)")
            value, i = words[i + 1], i + 2
        else:
            i += 1
        options[dest] = value
    program = words[i:]
    if not program:
        raise SpecError("the torchrun command names no script or module to run; add --script or -m")
    return TorchrunCall(options, program)


def job_name(name: str) -> str:
    """An app or role name as a valid ``job.name`` (1-63 letters, digits, '.', '_', '-')."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).lstrip("._-")[:63].rstrip("._-")
    return cleaned or "torchx"


@dataclass(frozen=True)
class MarindRequest:
    """What the scheduler submits: the job's id and the spec ``marind submit`` would store."""

    job_id: str
    spec: dict
    role: str
    ignored: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """The request as ``torchx run --dryrun`` prints it."""
        import json
        doc = {"id": self.job_id, "role": self.role, "spec": self.spec}
        if self.ignored:
            doc["ignored (marind's agent sets these)"] = list(self.ignored)
        return json.dumps(doc, indent=2, sort_keys=True)


def _shell_words(cmd: str) -> list[str]:
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _torchrun_words(entrypoint: str, args: list[str], app: str) -> list[str] | None:
    """The arguments after ``torchrun`` when the role runs torchrun, else None."""
    exe = os.path.basename(entrypoint)
    if exe == "torchrun":
        return list(args)
    if exe in PYTHONS and args[:2] == ["-m", "torch.distributed.run"]:
        return list(args[2:])
    if exe in SHELLS and len(args) == 2 and args[0] == "-c":
        words = _shell_words(args[1])
        inner = _torchrun_words(words[0], words[1:], app) if words else None
        if inner is not None:
            ops = sorted({w for w in words if w in SHELL_OPERATORS})
            if ops:
                raise SpecError(f"torchx app {app}: its shell command runs more than torchrun ({' '.join(ops)}); "
                                "marind runs one program per rank: move the other steps into the script")
        return inner
    return None


def _program(call: TorchrunCall, app: str) -> list[str]:
    opts, (script, *rest) = call.options, call.program
    if opts.get("module") and opts.get("no_python"):
        raise SpecError(f"torchx app {app}: torchrun -m and --no-python exclude each other; keep one")
    command = ["python", "-m", script, *rest] if opts.get("module") else (
        [script, *rest] if opts.get("no_python") else ["python", script, *rest])
    expanded = [w for w in command if "$" in w or "`" in w]
    if expanded:
        raise SpecError(f"torchx app {app}: the program's arguments {expanded} need a shell to expand; "
                        "marind runs the program without one: pass the values themselves")
    return command


def _int_option(value: Any, what: str, app: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise SpecError(f"torchx app {app}: {what} = {value!r}: marind needs a number (e.g. -j 2x4 for 4 per node)")


def _nodes(role: Role, call: TorchrunCall | None, app: str) -> tuple[int, int]:
    hi = int(role.num_replicas)
    lo = hi if role.min_replicas is None else int(role.min_replicas)
    if not 1 <= lo <= hi:
        raise SpecError(f"torchx app {app}: replicas {lo}:{hi}: marind needs 1 <= min_replicas <= num_replicas")
    if call is not None and call.options.get("nnodes") is not None:
        given = parse_nodes(call.options["nnodes"], "torchrun --nnodes")
        if given != (lo, hi):
            raise SpecError(f"torchx app {app}: torchrun --nnodes {call.options['nnodes']} disagrees with the "
                            f"role's replicas {lo}:{hi}; make them the same (-j MIN:MAXxPROCS)")
    return lo, hi


def _check_macros(role: Role, shell: bool, app: str) -> None:
    per_replica = [k for k, v in role.env.items() if macros.replica_id in str(v)]
    if not shell:
        per_replica += [a for a in role.args if macros.replica_id in a]
    if per_replica:
        raise SpecError(f"torchx app {app}: {per_replica} use ${{replica_id}}, but marind runs the same command "
                        "on every node; read GROUP_RANK (torchrun sets it) in the program instead")


def _base(run_toml: str | None) -> tuple[dict, Path | None]:
    if not run_toml:
        return {}, None
    path = Path(run_toml).expanduser().resolve()
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"run_toml {path}: {exc.strerror or exc}; give the path of an existing run.toml") from exc
    return load_toml(text, str(path), fix="; fix the syntax at that line"), path.parent


def app_to_request(app: AppDef, *, job_id: str | None = None, working_dir: str | None = None,
                   max_restarts: int | None = None, hang_timeout: str | None = None,
                   run_toml: str | None = None) -> MarindRequest:
    """The marind job an AppDef becomes (module docstring).

    Args:
        app: the TorchX application (one role).
        job_id: the id to submit under (default: a fresh ``{name}-{stamp}-{hex}``).
        working_dir: the workers' cwd (default: a base run.toml's ``job.working_dir``, else this cwd).
        max_restarts: ``job.max_restarts`` over what the role asks.
        hang_timeout: ``job.hang_timeout`` (a duration).
        run_toml: a base run.toml.

    Returns:
        The request.

    Raises:
        SpecError: what cannot map, or a spec marind refuses (one line naming the fix).
    """
    if len(app.roles) != 1:
        names = ", ".join(r.name for r in app.roles) or "none"
        raise SpecError(f"torchx app {app.name} has roles [{names}]: a marind job is one role (one elastic torchrun); "
                        "submit each role as its own app")
    role = app.roles[0]
    label = app.name or role.name
    if role.mounts:
        raise SpecError(f"torchx app {label}: mounts are not supported: marind runs on the nodes' own "
                        "filesystems; drop --mounts and use paths that exist on every node")
    if getattr(role, "workspace", None):
        raise SpecError(f"torchx app {label}: marind builds no workspace; its workers run in working_dir "
                        "(-cfg working_dir=...), which must exist on every node")
    base, base_dir = _base(run_toml)
    base_job = dict(base.get("job") or {})
    name = job_name(app.name or role.name)
    job_id = job_id or new_job_id(name)
    if working_dir:
        wd = Path(working_dir).expanduser().resolve()
    elif base_job.get("working_dir") and base_dir is not None:
        wd = (base_dir / str(base_job["working_dir"])).resolve()
    else:
        wd = Path.cwd()
    shell = os.path.basename(role.entrypoint) in SHELLS
    _check_macros(role, shell, label)
    role = macros.Values(img_root=str(wd), app_id=job_id, replica_id="$GROUP_RANK",
                         rank0_env="MASTER_ADDR").apply(role)
    words = _torchrun_words(role.entrypoint, list(role.args), label)
    call = parse_torchrun(words) if words is not None else None
    ignored: list[str] = []
    if call is not None:
        for dest in call.options:
            if dest in UNMAPPABLE:
                raise SpecError(f"torchx app {label}: torchrun --{dest.replace('_', '-')} cannot map: "
                                f"{UNMAPPABLE[dest]}; remove it")
        ignored = sorted(f"torchrun --{d.replace('_', '-')}" for d in call.options if d in AGENT_OWNED)
        command = _program(call, label)
        nproc = _int_option(call.options.get("nproc_per_node", 1), "torchrun --nproc-per-node", label)
    else:
        command = [role.entrypoint, *role.args]
        nproc = role.resource.gpu if role.resource.gpu > 0 else 1
    gpus = max(0, int(role.resource.gpu))
    if gpus and nproc > gpus:
        raise SpecError(f"torchx app {label}: {nproc} processes per node but the role's resource has {gpus} "
                        f"GPU(s); use -j Nx{gpus} or a host with more GPUs")
    lo, hi = _nodes(role, call, label)
    restarts = max_restarts
    if restarts is None and call is not None and call.options.get("max_restarts") is not None:
        restarts = _int_option(call.options["max_restarts"], "torchrun --max-restarts", label)
    if restarts is None and role.max_retries > 0:
        restarts = int(role.max_retries)
    for key in ("entrypoint", "command"):
        base_job.pop(key, None)
    base_job.update(name=name, nodes=f"{lo}:{hi}", nproc_per_node=nproc, command=command, working_dir=str(wd),
                    env={**(base_job.get("env") or {}), **{k: str(v) for k, v in role.env.items()}})
    if restarts is not None:
        base_job["max_restarts"] = restarts
    if hang_timeout:
        base_job["hang_timeout"] = hang_timeout
    spec = resolve_paths(RunSpec.from_dict({**base, "job": base_job}), base_dir or wd)
    problem = missing_paths(spec)
    if problem:
        raise SpecError(problem)
    if ignored:
        log.info("torchx_options_ignored", app=label, job=job_id, options=ignored)
    return MarindRequest(job_id=job_id, spec=spec.to_dict(), role=role.name, ignored=tuple(ignored))

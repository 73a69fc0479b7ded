"""What a job's torchrun runs with on this node: run dir, run.toml, command line, environment.

torchrun runs in the job's run dir (marind's files: logs, progress, run.toml); each worker
starts through ``marind.agent.warm_start.zygote_stub``, which enters ``[job] working_dir`` first. All of it
from the job's typed spec (``marind.core.spec.RunSpec``); every ``MARIND_*``
variable by its name in ``marind.core.workerenv``. ``marind.agent.supervisor`` runs the
command; ``marind.agent.launch.launch`` puts the two together.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from marind.agent.warm_start.zygote_stub import COMMAND_FLAG
from marind.core import workerenv as WE
from marind.core.spec import JobSpec, RunSpec


def _toml_key(key: str) -> str:
    return key if key and key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)          # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()
                               if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def spec_to_toml(spec: dict) -> str:
    """The spec dict (``RunSpec.to_dict()``) as run.toml; None values are left out.

    A program's own sections round-trip too: nested tables become sub-tables, tables inside
    arrays inline tables.
    """
    lines: list[str] = []

    def table(name: str, data: dict) -> None:
        lines.append(f"[{name}]")
        subtables = []
        for key, value in data.items():
            if value is None:
                continue
            if isinstance(value, dict):
                subtables.append((f"{name}.{_toml_key(key)}", value))
            else:
                lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
        lines.append("")
        for sub_name, sub in subtables:
            table(sub_name, sub)

    for section, data in spec.items():
        if isinstance(data, dict):
            table(_toml_key(section), data)
        elif data is not None:           # a top-level key outside any section
            lines.insert(0, f"{_toml_key(section)} = {_toml_value(data)}")
    return "\n".join(lines)


def torchrun_command(*, python: str, job: str, spec: RunSpec, endpoint: str, prefix: str,
                     run_toml: Path, rdzv_conf: str = "", backend: str = "etcd3",
                     replica_group: int | None = None) -> list[str]:
    """torchrun's command line for this node's part of ``job``.

    Args:
        python: the interpreter that runs torchrun.
        job: the job's id (the rendezvous id of an elastic job).
        spec: the job's spec.
        endpoint: etcd's endpoints, comma-separated (schemes are dropped).
        prefix: the marind key prefix in etcd.
        run_toml: the stored run.toml the entrypoint reads.
        rdzv_conf: extra ``--rdzv-conf`` entries, comma-separated.
        backend: the rendezvous backend.
        replica_group: torchft jobs: the node's replica-group slot.

    Returns:
        The argv.

    Raises:
        ValueError: a torchft job without ``replica_group``.
    """
    j = spec.job
    nodes, run_id = f"{j.nodes[0]}:{j.nodes[1]}", job
    if spec.fault.mode == "torchft":
        if replica_group is None:
            raise ValueError("a torchft job's torchrun needs the node's replica_group")
        # the group's nodes_per_group nodes (marind/agent/ft/coordinator.py) meet in a rendezvous of
        # their own, under the job's keys. Not --standalone: its c10d handler reuses the workers'
        # store across restarts, and restarted workers then dial the dead ones' addresses.
        nodes, run_id = str(spec.fault.nodes_per_group), f"rg-{replica_group}"
        prefix = f"{prefix.rstrip('/')}/jobs/{job}/ft"
    conf = [f"prefix={prefix}"] + [c for c in rdzv_conf.split(",") if c.strip()]
    endpoint = ",".join(e.split("://", 1)[-1] for e in endpoint.split(","))
    rdzv = [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={','.join(conf)}", f"--nnodes={nodes}"]
    # Every worker starts through the launcher (marind/agent/warm_start/zygote_stub.py): it enters job.working_dir,
    # then asks the zygote for a warm fork or execs the worker cold.
    worker = [COMMAND_FLAG, *j.command] if j.command else [j.entrypoint, str(run_toml)]
    return [python, "-m", "torch.distributed.run", *rdzv,
            f"--nproc-per-node={j.nproc_per_node}",
            f"--max-restarts={j.max_restarts}", "--monitor-interval=0.5",
            "-m", "marind.agent.warm_start.zygote_stub", *worker]


def warm_start_applies(job: JobSpec) -> bool:
    """Does this job get a zygote? ``warm_start``, and an entrypoint or a command run by python
    (the launcher decides per worker: ``marind.agent.warm_start.zygote_stub.python_target``)."""
    if not job.warm_start:
        return False
    return not job.command or os.path.basename(job.command[0]).startswith("python")


def worker_env(base: Mapping[str, str], *, job: str, node: str, run_dir: Path, spec: RunSpec,
               etcd_user: str | None = None, etcd_password: str | None = None) -> dict[str, str]:
    """The environment of a job's torchrun and workers (names in ``marind.core.workerenv``).

    Args:
        base: the agent's environment (systemd's notify variables are dropped).
        job: the job's id.
        node: this node's name.
        run_dir: the job's run dir on this node.
        spec: the job's spec (``job.env`` is added last, ``job.warm_start`` adds the zygote's).
        etcd_user: etcd credentials handed down to the workers.
        etcd_password: etcd credentials handed down to the workers.

    Returns:
        The environment.
    """
    env = dict(base)
    env.pop("NOTIFY_SOCKET", None)          # the workers are not the service
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({WE.RUN_DIR: str(run_dir), WE.RUN_TOML: str(run_toml_path(run_dir)), WE.JOB_ID: job, WE.NODE: node,
                "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": str(run_dir / "logs" / "error.json")})
    if spec.job.working_dir:
        env[WE.WORKING_DIR] = spec.job.working_dir
    if etcd_user:
        env[WE.ETCD_USER] = etcd_user
    if etcd_password:
        env[WE.ETCD_PASSWORD] = etcd_password
    if warm_start_applies(spec.job):
        env.update(zygote_env(job, run_dir, spec.job.preload))
    for key, value in spec.job.env:
        env[key] = value
    return env


def zygote_env(job: str, run_dir: Path, preload: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Where torchrun's zygote listens (an abstract socket of this agent and job) and what it loads.

    Args:
        job: the job's id.
        run_dir: the job's run dir (the zygote's pid map goes there).
        preload: ``[job] preload``: the modules the zygote imports besides torch.

    Returns:
        The ``MARIND_ZYGOTE_*`` variables.
    """
    return {WE.ZYGOTE_SOCKET: f"@marind-zygote-{os.getpid()}-{job}",
            WE.ZYGOTE_PIDS: str(run_dir / "zygote.pids.json"),
            WE.ZYGOTE_PRELOAD: ",".join(preload)}


def run_toml_path(run_dir: Path) -> Path:
    """The stored run.toml in a job's run dir (``MARIND_RUN_TOML``)."""
    return run_dir / "run.toml"


def prepare_run_dir(run_dir: Path, spec: RunSpec) -> Path:
    """Fresh progress dir, logs dir, run.toml.

    Args:
        run_dir: the job's run dir on this node.
        spec: the job's spec, written as run.toml.

    Returns:
        The run.toml path.
    """
    shutil.rmtree(run_dir / "progress", ignore_errors=True)
    (run_dir / "progress").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_toml_path(run_dir)
    path.write_text(spec_to_toml(spec.to_dict()))
    return path


def default_python() -> str:
    """The interpreter that runs torchrun when the config names none: the agent's own."""
    return sys.executable

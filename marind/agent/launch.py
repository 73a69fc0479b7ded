"""Start one job's torchrun on this node and the ``RunMonitor`` that watches it.

``torchrun_args`` builds what torchrun runs with; ``supervisor`` holds the process tree;
``run_monitor`` watches it. This module puts the three together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from marind.agent.ft.coordinator import FTCoordinator
from marind.agent.membership import Membership
from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.run_monitor import RunMonitor
from marind.agent.supervisor import TorchrunSupervisor
from marind.agent.torchrun_args import default_python, prepare_run_dir, torchrun_command, worker_env
from marind.control.config import AgentConfig
from marind.core.etcd_client import EtcdClient
from marind.core.spec import RunSpec


def launch(job: str, spec: RunSpec, *, run_dir: Path, config: AgentConfig, endpoint: str, node: str,
           ft: FTCoordinator | None, client: EtcdClient, outbox: Outbox, metrics: Metrics,
           registration: int = 1, on_disk_full: Callable[[str, Path, OSError], bool] | None = None
           ) -> RunMonitor | None:
    """Start this node's torchrun of a job and the monitor that watches it.

    Args:
        job: the job's id.
        spec: its spec.
        run_dir: its run dir on this node (prepared afresh: progress, logs, run.toml).
        config: the agent's settings (python, prefix, rendezvous options, etcd credentials).
        endpoint: etcd's endpoints.
        node: this node's name.
        ft: torchft jobs: the node's coordinator, holding a slot and a lighthouse.
        client: the etcd client (the job's membership watch).
        outbox: where state changes and events go.
        metrics: the agent's metrics.
        registration: the node's registration count (``NodeRegistry.generation``): after the
            first, the node's incarnation in the job is ``{agent_pid}.{registration}``.
        on_disk_full: told ``(what, path, error)`` of a write into the run dir that found the disk
            full (the state-dir watch; it returns whether it was one); the supervisor's too.

    Returns:
        The monitor of the started torchrun; None when the run dir could not be prepared because
        the disk is full (``on_disk_full`` was told; nothing started).

    Raises:
        OSError: the run dir could not be prepared for another reason.
    """
    try:
        run_toml = prepare_run_dir(run_dir, spec)
    except OSError as exc:
        if on_disk_full is not None and on_disk_full("the run dir", run_dir, exc):
            return None
        raise
    log = run_dir / "logs" / "torchrun.log"
    log_offset = log.stat().st_size if log.exists() else 0
    c = config
    cmd = torchrun_command(python=c.python or default_python(), job=job, spec=spec, endpoint=endpoint,
                           prefix=c.prefix, run_toml=run_toml, rdzv_conf=c.rdzv_conf,
                           replica_group=ft.slot if ft else None)
    env = worker_env(os.environ, job=job, node=node, run_dir=run_dir, spec=spec,
                     etcd_user=c.etcd_user, etcd_password=c.etcd_password)
    if ft is not None:
        env.update(ft.worker_env())
        ft.launched_slot = ft.slot
    sup = TorchrunSupervisor(job, run_dir, cmd, env, on_disk_full=on_disk_full)
    sup.start()
    incarnation = str(os.getpid()) if registration <= 1 else f"{os.getpid()}.{registration}"
    members = Membership(client, job, node, incarnation=incarnation)
    return RunMonitor(job, spec, sup, node=node, outbox=outbox, metrics=metrics, members=members, ft=ft,
                      log_offset=log_offset)

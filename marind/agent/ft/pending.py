"""torchft jobs this node is about to run: coordinators waiting for a slot and a lighthouse.

A torchft job's torchrun may start on a node only once the node holds a
replica-group slot and a lighthouse address is published
(``FTCoordinator.ready``). Until then its coordinator lives here and is
ticked on every look at the job. A running job whose node lost its slot
comes back here (``park``) and starts again once it holds one; a job that
ends while waiting is dropped (``drop``), releasing its keys.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from marind.agent.ft.coordinator import FTCoordinator
from marind.control.ft_status import is_torchft
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.core.spec import RunSpec


class PendingCoordinators:
    """The coordinators of this node's torchft jobs that have no torchrun (yet, or again).

    Args:
        client: the etcd client.
        node: this node's name.
        host: this node's address (``NodeRegistry.record["host"]``).
        lease: the node's current etcd lease.
    """

    def __init__(self, client: EtcdClient, node: str, host: Callable[[], str], lease: Callable[[], object]):
        self.client, self.node, self._host, self._lease = client, node, host, lease
        self._waiting: dict[str, FTCoordinator] = {}
        self._warned: set[str] = set()
        self.log = get_logger(__name__, node=node)

    def __contains__(self, job: str) -> bool:
        return job in self._waiting

    def ready(self, job: str, spec: RunSpec, run_dir: Path) -> tuple[bool, FTCoordinator | None]:
        """May the job's torchrun start on this node?

        Args:
            job: the job's id.
            spec: its spec.
            run_dir: its run dir on this node.

        Returns:
            (True, None) for a job that is not torchft; (True, its coordinator, handed over to
            the caller) once it holds a slot and a lighthouse; (False, None) not yet.
        """
        if not is_torchft(spec):
            return True, None
        ft = self._waiting.get(job)
        if ft is None:
            ft = self._waiting[job] = FTCoordinator(self.client, job, self.node, self._host(), spec, run_dir,
                                                    lease=self._lease)
        try:
            ft.tick()
        except ControlPlaneUnavailable:
            return False, None
        except Exception as exc:  # noqa: BLE001 - e.g. torchft not installed here; retried next tick
            if job not in self._warned:
                self.log.error("ft_not_ready", job=job, error=f"{type(exc).__name__}: {exc}")
                self._warned.add(job)
            return False, None
        if not ft.ready:
            return False, None
        return True, self._waiting.pop(job)

    def park(self, job: str, ft: FTCoordinator) -> None:
        """A running job's node lost its replica-group slot: wait here for one again."""
        self._waiting[job] = ft

    def drop(self, job: str) -> None:
        """The job ended: stop its waiting coordinator, if any."""
        ft = self._waiting.pop(job, None)
        if ft is not None:
            ft.stop()

"""What a torchft job's node does when its replica group ends (``[fault] mode = "torchft"``).

Two moments, both called from the agent's loop (``daemon``): the node lost its group slot
while its workers ran (``leave_replica_group``), and the group's torchrun gave up
(``group_failure_leaves``: the node leaves the job while other groups train on).
"""

from __future__ import annotations

import time
from typing import Any

from marind.agent.decisions import after_group_failure
from marind.agent.ft.coordinator import FTCoordinator
from marind.agent.link import Link
from marind.agent.run_monitor import RunMonitor
from marind.control.job_records import job_nodes
from marind.core.errors import ControlPlaneUnavailable


def leave_replica_group(run: RunMonitor, ft: FTCoordinator, why: str, *, link: Link,
                        runs: dict[str, RunMonitor], stop_timeout: float, log: Any) -> None:
    """Our replica-group slot went (the lease lapsed while etcd was away, and another node took
    it): the workers belong to a group we are no longer in. Stop them; the job starts again
    here once the coordinator holds a slot (it keeps running for the lighthouse meanwhile).

    Args:
        run: the job's monitor on this node.
        ft: its torchft coordinator.
        why: the reason, for the restart event.
        link: the agent's etcd link (outbox, watch, parked torchft jobs).
        runs: the agent's runs by job id; ``run`` is removed from it.
        stop_timeout: seconds torchrun gets to stop before it is killed.
        log: the agent's logger.
    """
    log.warning("ft_group_changed", job=run.job, was=ft.launched_slot, now=ft.slot)
    run.settle_hang(time.time())
    run.stop(stop_timeout)
    runs.pop(run.job, None)
    link.ft_pending.park(run.job, ft)
    link.watch.poke()
    link.outbox.event(run.job, "restart", {"reason": why})


def group_failure_leaves(run: RunMonitor, ft: FTCoordinator, rc: int, *, link: Link, node: str,
                         log: Any) -> bool:
    """A torchft replica group on this node gave up (restarts exhausted): this node leaves the
    job, and the job fails only if no other node is still in it. Our record goes first, then
    we count the others, so of several groups failing at once the last to leave sees none.

    Args:
        run: the job's monitor on this node (its torchrun exited ``rc``).
        ft: its torchft coordinator.
        rc: torchrun's exit code.
        link: the agent's etcd link.
        node: this node's name.
        log: the agent's logger.

    Returns:
        True when this node left and the other groups train on (the job is not failed);
        False when this was the last node, so the job fails.
    """
    key = link.client.key("jobs", run.job, "nodes", node)
    others: list[str] | None
    try:
        link.client.delete(key)
        others = sorted(n for n in job_nodes(link.client, run.job) if n != node)
    except ControlPlaneUnavailable:
        others = None
    leave, _ = after_group_failure(others)
    if not leave:
        return False
    log.warning("ft_group_failed", job=run.job, rc=rc, replica_group=ft.launched_slot,
                others=others, action="this node leaves the job; the other groups train on")
    run.final_progress()
    link.outbox.event(run.job, "group_failed", {"rc": rc, "replica_group": ft.launched_slot, "step": run.step,
                                                "remaining_nodes": others})
    link.outbox.leaving(run.job, run.members, f"torchrun exited {rc}: replica group failed")
    return True

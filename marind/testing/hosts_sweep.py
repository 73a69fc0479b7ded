"""Removing a bed's network, and the beds whose owner died without removing theirs.

A test run killed hard (SIGKILL, a lost CI runner) cannot tear its bed
down. Every bed therefore registers itself in ``/run/marind-beds/{id}.json``
(its plan, its owner's pid and start time, its servers' pids); the next bed
built on the machine removes every registered bed whose owner is gone. A
bed whose owner still runs is never touched, so concurrent beds are safe.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil

from marind.core.log import get_logger
from marind.testing import hosts_net as net
from marind.testing.hosts_plan import NETS, BedPlan, from_state, to_state

log = get_logger("testing.hosts")

REGISTRY = Path("/run/marind-beds")


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def register(plan: BedPlan, server_pids: list[int] | tuple[int, ...] = ()) -> None:
    """Record ``plan`` (and its servers) as owned by this process."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    doc = {"state": to_state(plan), "owner": {"pid": os.getpid(), "start": _start_time(os.getpid())},
           "servers": [{"pid": p, "start": _start_time(p)} for p in server_pids]}
    path = REGISTRY / f"{plan.bed_id}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def unregister(bed_id: str) -> None:
    (REGISTRY / f"{bed_id}.json").unlink(missing_ok=True)


def remove_network(plan: BedPlan) -> None:
    """Kill every process in the bed's namespaces, then delete them, their links, the bridges and
    the ``/etc/netns`` entries (each step tolerates what is already gone)."""
    for host in plan.hosts:
        net.kill_netns_processes(host.netns)
    for host in plan.hosts:
        net.delete_netns(host.netns)
        for n in NETS:
            net.delete_link(host.link(n).veth)
        net.remove_etc_netns(host.netns)
    for n in NETS:
        net.delete_link(plan.bridges[n])


def _alive(entry: dict) -> bool:
    start = _start_time(int(entry.get("pid") or 0))
    return start is not None and (entry.get("start") is None or abs(start - entry["start"]) < 0.01)


def sweep_stale() -> list[str]:
    """Remove every registered bed whose owner process is gone; the ids removed."""
    removed = []
    for path in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
            if _alive(doc["owner"]):
                continue
            plan = from_state(doc["state"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("bed_registry_unreadable", path=str(path), error=str(exc))
            continue
        for server in doc.get("servers", []):
            if _alive(server):
                net.signal_pids([int(server["pid"])], signal.SIGKILL)
        remove_network(plan)
        path.unlink(missing_ok=True)
        log.warning("stale_bed_removed", bed=plan.bed_id, owner=doc["owner"].get("pid"))
        removed.append(plan.bed_id)
    return removed

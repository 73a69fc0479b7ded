"""A torchft job's keys as every reader sees them: its ``[fault]`` settings, its groups, its status.

The agent's ``FTCoordinator`` (``marind.agent.ft.coordinator``) writes the keys under
``{p}/jobs/{job}/ft/``; ``marind status`` and the agent read them through these functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from marind.core.etcd_client import EtcdClient
from marind.core.spec import FaultSpec, RunSpec


def fault_settings(spec: RunSpec | FaultSpec | Mapping) -> FaultSpec:
    """The ``[fault]`` settings of a job.

    Args:
        spec: the job's spec, its ``fault`` section, or a mapping in ``RunSpec.to_dict()``'s
            form (only its ``fault`` table is read; durations in seconds).

    Returns:
        The settings.

    Raises:
        TypeError: the mapping's ``fault`` table has a key ``FaultSpec`` does not know.
    """
    if isinstance(spec, RunSpec):
        return spec.fault
    if isinstance(spec, FaultSpec):
        return spec
    return FaultSpec(**dict(spec.get("fault") or {}))


def is_torchft(spec: RunSpec | Mapping) -> bool:
    """Does the job run under ``fault.mode = "torchft"``?

    Args:
        spec: the job's spec, or a mapping in ``RunSpec.to_dict()``'s form (a stored spec).

    Returns:
        True for a torchft job.
    """
    if isinstance(spec, RunSpec):
        return spec.fault.mode == "torchft"
    return (spec.get("fault") or {}).get("mode") == "torchft"


def group_members(records: dict) -> dict[int, dict[int, str]]:
    """``{group: {member: node}}`` from the records under ``.../ft/groups/`` (keyed by full key)."""
    out: dict[int, dict[int, str]] = {}
    for key, rec in records.items():
        try:
            group, member = (int(x) for x in key.rsplit("/", 2)[-2:])
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("node"):
            out.setdefault(group, {})[member] = str(rec["node"])
    return out


def ft_status(client: EtcdClient, job: str, nodes: dict | None = None) -> dict | None:
    """What ``marind status`` shows of a torchft job; None when the job has no torchft keys.

    ``{"lighthouse": {node, address, epoch}|None, "quorum_id", "participants",
    "groups": [{slot, member, node, state, step, participants, quorum_id, lighthouse}]}`` (a row per
    member node, by group then member); ``nodes`` are the
    job's per-node records (``{p}/jobs/{job}/nodes/*``, keyed by node) carrying each group's ``ft``.
    """
    prefix = client.key("jobs", job, "ft")
    groups = client.get_prefix_json(prefix + "/groups/")
    value, rev = client.get(prefix + "/lighthouse")
    if not groups and value is None:
        return None
    lighthouse = None
    if value is not None:
        try:
            rec = json.loads(value)
            lighthouse = {"node": rec.get("node"), "address": rec.get("address"), "epoch": rev}
        except ValueError:
            lighthouse = None
    rows = []
    for slot, members in group_members(groups).items():
        for member, node in members.items():
            nrec = (nodes or {}).get(node) or {}
            ft = nrec.get("ft") or {}
            rows.append({"slot": slot, "member": member, "node": node, "state": nrec.get("state", "absent"),
                         "step": nrec.get("step"), "participants": ft.get("participants"),
                         "quorum_id": ft.get("quorum_id"),
                         "lighthouse": bool(lighthouse and lighthouse["node"] == node)})
    rows.sort(key=lambda r: (r["slot"], r["member"]))
    latest = max((r for r in rows if r["quorum_id"] is not None), key=lambda r: r["quorum_id"], default=None)
    return {"lighthouse": lighthouse, "groups": rows,
            "quorum_id": latest["quorum_id"] if latest else None,
            "participants": latest["participants"] if latest else None}

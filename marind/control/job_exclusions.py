"""Nodes taken out of a job for its stragglers: ``{p}/jobs/{job}/excluded/{node}`` (docs/design.md §2, §11).

With ``[fault] straggler_action = "exclude"``, the agent that names a job's stragglers (the one that
runs global rank 0, ``marind.agent.stragglers``) takes the node of the slowest straggler out of the
job, one node at a time, when the job keeps at least its minimum node count without it
(:func:`exclusion_decision`, pure). The key is created once and kept until ``marind rm``: the
node's agent stops its part of the job (a clean departure: its workers end, the others' torchruns
form a new round without it, the ordinary path of a node that leaves) and does not start the job
again, even after an agent restart. Only jobs that set the action are read for exclusions, so
the others cost no extra etcd request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from marind.core.etcd_client import EtcdClient


def excluded_key(client: EtcdClient, job: str, node: str | None = None) -> str:
    """``{p}/jobs/{job}/excluded/{node}`` (without ``node``: the prefix, ending in ``/``)."""
    return client.key("jobs", job, "excluded", node) if node else client.key("jobs", job, "excluded") + "/"


@dataclass(frozen=True)
class ExclusionDecision:
    """The node to take out of the job (None: none) and why, in words."""

    node: str | None
    reason: str


def exclusion_decision(stragglers: Mapping[str, float], job_nodes: Collection[str], min_nodes: int,
                       excluded: Collection[str] = ()) -> ExclusionDecision:
    """Which node to take out of a job for its stragglers.

    Args:
        stragglers: the ranks named now (``node/rank`` -> median compute seconds per step).
        job_nodes: the nodes running the job now.
        min_nodes: the job's minimum node count (``job.nodes``' first figure).
        excluded: nodes already taken out.

    Returns:
        The node whose straggler is slowest (the first by name on a tie), if the job keeps at least
        ``min_nodes`` nodes without it; else None, saying why not.
    """
    slow: dict[str, float] = {}
    for rank_id, seconds in stragglers.items():
        node = rank_id.rsplit("/", 1)[0]
        if node in job_nodes and node not in excluded:
            slow[node] = max(seconds, slow.get(node, 0.0))
    if not slow:
        return ExclusionDecision(None, "no straggler on a node of the job")
    node = sorted(slow, key=lambda n: (-slow[n], n))[0]
    left = len(set(job_nodes) - set(excluded) - {node})
    if left < min_nodes:
        return ExclusionDecision(None, f"node {node} keeps its straggler: without it the job would have {left} "
                                       f"node(s), under its minimum of {min_nodes} (job.nodes)")
    return ExclusionDecision(node, f"node {node} taken out of the job: its straggler computes {slow[node]:.3g}s "
                                   f"per step; {left} node(s) go on")


def exclude(client: EtcdClient, job: str, node: str, detail: Mapping[str, Any], by: str) -> bool:
    """Write the exclusion of ``node`` (created once); True when this call wrote it."""
    doc = {"node": node, "by": by, "at": time.time(), **detail}
    return client.create(excluded_key(client, job, node), json.dumps(doc, sort_keys=True))


def exclusion_of(client: EtcdClient, job: str, node: str) -> dict | None:
    """``node``'s exclusion from ``job``, or None (``ControlPlaneUnavailable`` propagates)."""
    doc = client.get_json(excluded_key(client, job, node))
    return doc if isinstance(doc, dict) else None


def excluded_nodes(client: EtcdClient, job: str) -> dict[str, dict]:
    """Every node taken out of ``job``: node -> its exclusion."""
    prefix = excluded_key(client, job)
    return {key[len(prefix):]: doc for key, doc in client.get_prefix_json(prefix).items() if isinstance(doc, dict)}

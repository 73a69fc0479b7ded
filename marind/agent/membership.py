"""Which nodes left a job, and how: one ``node_lost`` event per lost node, whoever notices.

Each node of a job keeps ``{p}/jobs/{job}/nodes/{node}`` under its lease,
with the pid of its agent (``agent_pid``): one incarnation of the node.
An agent that ends its part cleanly first writes
``{p}/jobs/{job}/departed/{node}/{agent_pid}`` (``how: "left"``), then
deletes its record; an agent that dies just loses its record when its lease
expires, or has it replaced by its next incarnation. Every agent of the job
compares the incarnations it sees with the ones it saw before; for one that
vanished it tries to *create* the departed key (``how: "lost"``). Only the
agent whose create succeeds emits the event, so a loss is recorded once,
even when the node of global rank 0 is the one that died.
"""

from __future__ import annotations

import json
import time

from marind.core.etcd_client import EtcdClient


def vanished(before: dict[str, str], now: dict[str, str], me: str) -> list[tuple[str, str]]:
    """(node, incarnation) seen before and gone or replaced now, except this node's (pure)."""
    return sorted((node, inc) for node, inc in before.items() if node != me and now.get(node) != inc)


class Membership:
    """One agent's view of one job's nodes."""

    def __init__(self, client: EtcdClient, job: str, node: str, incarnation: str):
        self.client, self.job, self.node, self.incarnation = client, job, node, str(incarnation)
        self.known: dict[str, str] = {}

    def _departed_key(self, node: str, incarnation: str) -> str:
        return self.client.key("jobs", self.job, "departed", node, incarnation)

    def leaving(self, why: str) -> None:
        """This node ends its part cleanly: the others must not report it lost."""
        self.client.put(self._departed_key(self.node, self.incarnation),
                        json.dumps({"how": "left", "reason": why, "at": time.time()}))

    def poll(self) -> list[str]:
        """Nodes lost since the last poll that this agent is the first to notice."""
        prefix = self.client.key("jobs", self.job, "nodes") + "/"
        now = {key.rsplit("/", 1)[-1]: str(rec.get("agent_pid", "?"))
               for key, rec in self.client.get_prefix_json(prefix).items() if isinstance(rec, dict)}
        lost = []
        for node, inc in vanished(self.known, now, self.node):
            if self.client.create(self._departed_key(node, inc),
                                  json.dumps({"how": "lost", "seen_by": self.node, "at": time.time()})):
                lost.append(node)
        self.known = now
        return lost

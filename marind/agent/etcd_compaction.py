"""Keeping etcd's history bounded: the agents compact it (docs/design.md §1, "etcd's history").

etcd keeps every revision of every key until a compaction drops the older ones. A job's agents
rewrite their node records every report (~0.8 KB a node every 2 s), so an etcd that nobody
compacts grows by ~35 GB a day at 1,000 nodes, and by ~0.35 GB a day at 10, until it reaches its
space quota (2 GiB by default) and refuses every write (the NOSPACE alarm): every agent then
loses its registration and every job stops. An etcd run with ``--auto-compaction-retention``
never gets there; marind does not count on it. Every agent, every ``etcd.compact_interval``
(default 5 min; 0 = off), compacts to the revision it noted one interval before: history older
than one interval goes, newer history stays (marind's watches start from revisions seconds old).
With N agents that is N requests per interval; the first to reach a revision compacts it and
the others find it done. Bounded: the history kept is at most two intervals of writes (~240 MB
at 1,000 nodes with the default), and etcd reuses the space a compaction freed.
"""

from __future__ import annotations

from dataclasses import dataclass

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Noted:
    """A revision of etcd's and when this agent saw it."""

    at: float
    revision: int


def compaction_action(now: float, noted: Noted | None, interval: float) -> tuple[str, str]:
    """What a tick does (pure): ``("off" | "wait" | "note" | "compact", why)``. ``note``: read
    etcd's revision to compact to one interval later; ``compact``: compact to ``noted``'s
    revision, then note the current one."""
    if interval <= 0:
        return "off", "etcd.compact_interval = 0"
    if noted is None:
        return "note", "no revision noted yet: note one now, compact to it one interval later"
    if now - noted.at < interval:
        return "wait", f"noted {now - noted.at:.0f}s ago, under the {interval:g}s interval"
    return "compact", f"revision {noted.revision} is {now - noted.at:.0f}s old"


class Compactor:
    """One agent's part in keeping etcd's history bounded (module doc).

    Args:
        interval: seconds between compactions (``etcd.compact_interval``; 0: off).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.noted: Noted | None = None
        self.compacted_to: int | None = None       # the last revision this agent compacted to

    def tick(self, client: EtcdClient, now: float) -> None:
        """Compact when due, and note etcd's revision for the next time; an unreachable etcd
        waits for the next tick (nothing here is urgent)."""
        action, _ = compaction_action(now, self.noted, self.interval)
        if action in ("off", "wait"):
            return
        try:
            if action == "compact" and self.noted is not None:
                if client.compact(self.noted.revision):
                    self.compacted_to = self.noted.revision
                    log.info("etcd_compacted", revision=self.noted.revision)
            self.noted = Noted(now, client.revision())
        except ControlPlaneUnavailable as exc:
            log.info("etcd_compaction_deferred", error=str(exc))

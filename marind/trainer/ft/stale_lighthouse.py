"""A group alone in a quorum right after its own long stall may be on a stale lighthouse (torchft).

A host that loses power and comes back brings back what ran on it, a lighthouse included. When the
others elected a new lighthouse meanwhile, the old one still holds its old view: it has heard from
none of them for long, so the resumed group alone is a valid quorum there, and the group would train
on its own history until its agent, catching up with etcd, points it at the new lighthouse. It then
merges with the others by step count alone: equal counts are never healed (the groups keep
different parameters while every later gradient norm matches), a larger count makes the others
heal from it (their steps of the outage are thrown away). This was reproduced with real groups
(``tests/torchft/test_ft_split_brain.py``): about ten steps committed alone on the resumed
lighthouse in eight seconds.

So a group that finds itself alone in a new quorum, having been in a larger one, after its own
process stood still for longer than ``fault.heartbeat_timeout`` since its previous quorum (the
others may have moved on without it)
(:class:`FreezeWatch`: a thread that ticks every ``TICK_S`` sees the gap; a slow step is not a
freeze), and that follows its agent's lighthouse file, does not train yet: it waits up to ``LIGHTHOUSE_WAIT_S`` for the file's
epoch to move (then its quorum is given up and the Manager rebuilt on the new lighthouse) and trains
alone only when it did not (the others are really gone). :func:`decide_alone` is the decision.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

TICK_S = 0.25      # the freeze watch's tick


class FreezeWatch:
    """A daemon thread that notices when this whole process stood still (SIGSTOP, a host frozen or
    powered off and back): the gap between two of its ticks, when longer than ``threshold``."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.frozen_at: float | None = None      # time.monotonic() when the latest freeze was seen
        self.longest = 0.0
        threading.Thread(target=self._run, name="ft-freeze-watch", daemon=True).start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            if now - last > self.threshold:
                self.frozen_at, self.longest = now, now - last
            last = now

    def frozen_since(self, since: float | None) -> float | None:
        """The length of a freeze seen after ``since`` (monotonic), else None."""
        if self.frozen_at is None or since is None or self.frozen_at < since:
            return None
        return self.longest


@dataclass(frozen=True)
class AloneDecision:
    """Whether to wait for the agent's word before training alone, and why (for the log)."""

    wait: bool
    reason: str


def decide_alone(*, participants: int, previous: int | None, frozen_s: float | None, heartbeat_timeout: float,
                 agent_file: bool) -> AloneDecision:
    """Decide whether a new quorum of this group alone must wait for the lighthouse file.

    Args:
        participants: the new quorum's participants.
        previous: the previous quorum's participants (None before the first).
        frozen_s: how long this process stood still since the previous quorum (None: it did not).
        heartbeat_timeout: ``fault.heartbeat_timeout``.
        agent_file: the lighthouse comes from the agent's file (without an agent nothing would move it).

    Returns:
        Wait when all of these hold: alone now, more than one before, frozen longer than
        ``heartbeat_timeout`` since, and an agent's file to wait on.
    """
    if participants != 1 or previous is None or previous <= 1:
        return AloneDecision(False, "not a quorum that shrank to this group")
    if frozen_s is None or frozen_s <= heartbeat_timeout:
        return AloneDecision(False, "this group did not stand still: the others left")
    if not agent_file:
        return AloneDecision(False, "no agent's lighthouse file to wait on")
    return AloneDecision(True, f"alone after standing still {frozen_s:.1f}s since its previous quorum of {previous} "
                               f"(> heartbeat_timeout {heartbeat_timeout:g}s): this lighthouse may be stale")

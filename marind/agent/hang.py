"""Pure stall detection with an injected clock.

The supervisor feeds ``observe(now, marker)`` with a progress marker of
the node's current worker generation (e.g. ``(min step, phase)`` over its
ranks); ``check(now)`` answers whether the marker has not changed for
longer than ``timeout`` seconds, and why. The detector arms only once a
marker has been seen (an entrypoint that never writes progress is never
called hung) and ``reset`` re-arms it for a new generation.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class HangDetector:
    """Stall detection for one job's current round (the clock is the caller's ``now``).

    Args:
        timeout: seconds without a change of marker that make a hang (``job.hang_timeout``).
    """

    timeout: float
    _marker: Hashable | None = None
    _since: float | None = None

    def reset(self) -> None:
        """Disarm until a marker is seen again (a new round)."""
        self._marker = None
        self._since = None

    def observe(self, now: float, marker: Hashable | None) -> None:
        """Note the round's progress marker at ``now``; None (no progress record yet) is ignored."""
        if marker is None:
            return
        if marker != self._marker:
            self._marker = marker
            self._since = now

    def check(self, now: float) -> tuple[bool, str]:
        """(hung, why) at ``now``."""
        if self._since is None:
            return False, "no progress seen yet"
        stalled = now - self._since
        if stalled > self.timeout:
            return True, f"no progress for {stalled:.0f}s (hang_timeout {self.timeout:.0f}s) at {self._marker}"
        return False, f"progress {stalled:.0f}s ago"

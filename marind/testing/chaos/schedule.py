"""Failure times drawn from a seed, for ``chaos/schedule.py`` and ``bench/goodput.py``.

Pure: the same arguments give the same schedule, so a run is reproduced
from its seed and the schedule can be tested without processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Draw:
    """One failure of a schedule.

    Attributes:
        index: its position in the schedule (0 first).
        at: seconds after the schedule's start.
        seed: the seed handed to this run of the injector.
    """

    index: int
    at: float
    seed: int


def draw_schedule(seed: int, every: float, duration: float, *, max_actions: int | None = None,
                  fixed: bool = False, min_gap: float = 0.0) -> list[Draw]:
    """The failure times for ``seed`` (pure: same arguments, same schedule).

    Exponential inter-arrival times with mean ``every`` (or exactly
    ``every`` when ``fixed``), each at least ``min_gap``; every draw lies
    in ``(0, duration]``; at most ``max_actions`` draws.

    Args:
        seed: seeds the gaps and each draw's own seed.
        every: mean (or, with ``fixed``, exact) seconds between failures.
        duration: seconds the schedule spans.
        max_actions: at most this many draws (None: no limit).
        fixed: fixed rather than exponential gaps.
        min_gap: the shortest gap between two failures.

    Returns:
        The draws in time order.

    Raises:
        ValueError: ``every`` is not positive, or ``duration`` or ``min_gap`` is negative.
    """
    if every <= 0:
        raise ValueError("--every must be > 0 seconds")
    if duration < 0 or min_gap < 0:
        raise ValueError("--duration and --min-gap must be >= 0")
    rng = random.Random(seed)
    draws: list[Draw] = []
    t = 0.0
    while max_actions is None or len(draws) < max_actions:
        gap = every if fixed else rng.expovariate(1.0 / every)
        t += max(gap, min_gap)
        if t > duration:
            break
        draws.append(Draw(index=len(draws), at=round(t, 3), seed=rng.randrange(2**31)))
    return draws

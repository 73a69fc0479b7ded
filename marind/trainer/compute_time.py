"""One rank's compute time per step, time waiting in collectives left out (stragglers).

In synchronous training every rank's step takes as long as the slowest rank's: the step time
cannot tell a slow rank from its peers. The time a rank spends computing can: the loop times
the forward/backward pass and the optimizer step with :class:`ComputeTimer` (not the gradient
all-reduce, the clipping's norm reduction, nor the loop's own all-reduce) and reports the sum as
the progress record's ``compute_s``; the agents compare it across the job
(``marind.agent.stragglers``). Collectives inside the backward pass (FSDP's reduce-scatter, a
pipeline's sends) are counted as compute: the figure is a bound, equal on healthy peers.

On a GPU the timer synchronises the device at each edge (the all-reduce that follows would wait
for the kernels anyway). Test hook: ``MARIND_TEST_COMPUTE_SLEEP=S`` adds S seconds of "compute" to
every step of the ranks that have it (a slow rank, for the straggler tests).
"""

from __future__ import annotations

import os
import time
from types import TracebackType

import torch

TEST_COMPUTE_SLEEP = "MARIND_TEST_COMPUTE_SLEEP"


def _sleep_hook() -> float:
    raw = os.environ.get(TEST_COMPUTE_SLEEP, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{TEST_COMPUTE_SLEEP} = {raw!r} must be a number of seconds") from None
    if value < 0:
        raise ValueError(f"{TEST_COMPUTE_SLEEP} = {raw!r} must not be negative")
    return value


class ComputeTimer:
    """Sums the time spent inside ``with timer:`` blocks until :meth:`take`.

    Args:
        device: the rank's device (a CUDA device is synchronised at each edge).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.sleep_s = _sleep_hook()
        self.total = 0.0
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> ComputeTimer:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._sync()
        self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        """The step's compute seconds (with the test hook's sleep), and start the next step at 0."""
        if self.sleep_s:
            time.sleep(self.sleep_s)
            self.total += self.sleep_s
        total, self.total = self.total, 0.0
        return round(total, 6)

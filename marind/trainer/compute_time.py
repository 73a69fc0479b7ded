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
every step of the ranks that have it (a slow rank, for the straggler tests), slept at the end of the
forward/backward pass: the peers wait for it in the next collective, which is not timed.

Under FSDP (elastic mode) the all-gathers and reduce-scatters inside forward and backward are
timed with them: a rank slow *inside* forward/backward makes its peers wait there too, which
narrows the gap the agents see (a slow optimizer step or data path, and the hook, stand out whole).
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
        self._slept = False

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> ComputeTimer:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.sleep_s and not self._slept:       # the test hook: once per step, inside the timed part
            self._slept = True
            time.sleep(self.sleep_s)
        self._sync()
        self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        """The step's compute seconds, and start the next step at 0."""
        total, self.total, self._slept = self.total, 0.0, False
        return round(total, 6)

"""Local disks: which write path a save's chunk objects take, chosen from what the disk did.

``O_DIRECT`` (no page cache) costs the machine least, which is what an async
save running beside training needs (``direct_io.write_direct`` says why;
docs/perf.md has the figures), so async saves always take it. A sync save is waited for, so it
takes whichever path wrote faster on this disk: the two are not equal
everywhere. A direct write is cut into requests of at most the device's
``max_segments`` pages (4 KiB each: 512 KiB on a loop device, about 1 MiB on
virtio), where the page cache's writeback sends larger ones; on a disk that
caps I/O operations as well as bandwidth (cloud block storage) that costs time:
on the bench's slow target (a loop-mounted ext4 with a bandwidth and a write
IOPS cap) direct writes of the bench's state were the slower, while with the
bandwidth cap alone both ran at the disk's rate (docs/perf.md, "Checkpoints:
write path"). On a VM that hands free pages back to its host the page cache is the slow
one. So the first two sync saves try each path, later ones take the faster
(the median of the last ``KEEP`` rates of each), and every ``REPROBE``-th sync
save tries the other again. Each rank decides alone (each writes only its own
objects).
"""

from __future__ import annotations

import statistics
import threading

KEEP = 3          # rates kept per path
REPROBE = 16      # every this many sync saves, the path not taken is tried again


def choose_direct(direct_rates: list[float], buffered_rates: list[float], sync_saves: int,
                  background: bool) -> tuple[bool, str]:
    """Whether a save's objects go around the page cache, and why.

    Args:
        direct_rates, buffered_rates: bytes/s of earlier sync saves' chunk writes, by path.
        sync_saves: sync saves this storage made before this one.
        background: an async save (it runs beside training).

    Returns:
        (direct?, the reason).
    """
    if background:
        return True, "async save: O_DIRECT costs training least"
    if not direct_rates:
        return True, "first sync save: trying O_DIRECT"
    if not buffered_rates:
        return False, "trying the page cache"
    direct, buffered = statistics.median(direct_rates), statistics.median(buffered_rates)
    best = direct >= buffered
    if sync_saves % REPROBE == 0:
        return not best, "trying the slower path again"
    return best, f"faster here ({direct / 1e6:.0f} MB/s direct, {buffered / 1e6:.0f} MB/s buffered)"


class WriteModes:
    """One storage's record of its sync saves' write rates by path (thread-safe)."""

    def __init__(self) -> None:
        self.rates: dict[bool, list[float]] = {True: [], False: []}
        self.sync_saves = 0
        self._lock = threading.Lock()

    def choose(self, background: bool) -> tuple[bool, str]:
        """The path for the next save (``choose_direct``)."""
        with self._lock:
            return choose_direct(self.rates[True], self.rates[False], self.sync_saves, background)

    def record(self, direct: bool, nbytes: int, seconds: float, background: bool) -> None:
        """A save's chunk writes took ``seconds`` for ``nbytes`` on that path (sync saves count)."""
        if background or nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.sync_saves += 1
            kept = self.rates[direct]
            kept.append(nbytes / seconds)
            del kept[:-KEEP]

"""``num_nodes_waiting`` from a watch: torch's elastic agent asks every monitor interval, etcd rarely.

torchrun's agent calls ``num_nodes_waiting()`` every ``--monitor-interval`` (0.5 s as marind
starts it) while its workers run, to restart them into a larger round when nodes wait. A
count read each time (even cached for a second) was the largest part of a node's steady
etcd traffic (docs/perf.md, "A thousand nodes"). ``WaitingCount`` watches the keys of the
round after the current one (``rounds/{r+1}/``, where a joiner or a spare writes its key)
and counts them again only after an event there, at most once a ``min_s``, and at least
every ``resync_s`` (an event lost with a broken watch). The watch is a ``PrefixWatch``
(``marind.core.etcd_watch``), whose callback holds no reference to the handler, so a dropped
handler is still collected (its keep-alive thread ends with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from marind.core.etcd_client import EtcdClient
from marind.core.etcd_watch import PrefixWatch

#: at most one count this often (torch caches its own state for a second too)
MIN_S = 1.0
#: at least one count this often, whatever the watch says
RESYNC_S = 30.0


class WaitingCount:
    """The number of torchruns waiting for the round after ``round_`` (a watch-driven cache).

    Args:
        client: the rendezvous' etcd client.
        prefix_of: the prefix of a round's join and spare keys (``rounds/{r}/``).
        count: counts the keys under a prefix (raises on an outage).
        clock: monotonic time (tests).
    """

    def __init__(self, client: EtcdClient, prefix_of: Callable[[int], str], count: Callable[[str], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._prefix_of, self._count, self._clock = client, prefix_of, count, clock
        self._watch: PrefixWatch | None = None
        self._round: int | None = None
        self._value: tuple[float, int] | None = None

    def get(self, round_: int) -> int:
        """How many torchruns joined round ``round_ + 1`` (raises what ``count`` raises)."""
        if round_ != self._round or self._watch is None:
            self.close()
            self._round, self._value = round_, None
            self._watch = PrefixWatch(self._client, self._prefix_of(round_ + 1))
        watch = self._watch
        watch.ensure()                     # no watch: counted every MIN_S, as without one
        now = self._clock()
        since = now - self._value[0] if self._value is not None else None
        due = since is None or since >= RESYNC_S or ((watch.changed or not watch.live) and since >= MIN_S)
        if due:
            watch.take()
            self._value = (now, self._count(self._prefix_of(round_ + 1)))
        assert self._value is not None
        return self._value[1]

    def forget(self) -> None:
        """Count at the next ``get`` whatever the watch said (tests, an outage)."""
        self._value = None

    def close(self) -> None:
        """Cancel the watch."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

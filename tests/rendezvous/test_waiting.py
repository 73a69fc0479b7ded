"""``num_nodes_waiting`` counts the next round's joiners again only after a join there (a watch).

torchrun asks every 0.5 s while its workers run; counting each time (cached for a second) was
a node's largest steady etcd cost (docs/perf.md, "A thousand nodes"). The clock is injected:
no sleeping, no timing; the counts are those ``WaitingCount`` asked for.
"""

from __future__ import annotations

from marind.rendezvous.waiting import MIN_S, RESYNC_S, WaitingCount
from tests.agent.helpers import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_again_only_after_a_join_or_the_resync(etcd_client):
    asked: list[str] = []
    base = etcd_client.key("rdzv-waiting")

    def prefix_of(round_: int) -> str:
        return f"{base}/rounds/{round_}/join/"

    def count(prefix: str) -> int:
        asked.append(prefix)
        return etcd_client.count_prefix(prefix)

    clock = Clock()
    waiting = WaitingCount(etcd_client, prefix_of, count, clock=clock)
    try:
        assert waiting.get(1) == 0 and len(asked) == 1
        for _ in range(20):                       # torchrun's monitor, 10 s of it: no count
            clock.now += 0.5
            assert waiting.get(1) == 0
        assert len(asked) == 1

        etcd_client.put(prefix_of(2) + "a", "x")  # a node joins round 2: counted again
        clock.now += MIN_S
        wait_for(lambda: waiting.get(1) == 1, 10, "the join counted")
        assert asked == [prefix_of(2)] * 2

        etcd_client.put(prefix_of(5) + "b", "x")  # another round's key: no count
        clock.now += RESYNC_S - 1
        assert waiting.get(1) == 1 and len(asked) == 2
        clock.now += 1                            # the resync: counted whatever the watch says
        assert waiting.get(1) == 1 and len(asked) == 3

        assert waiting.get(4) == 1 and asked[-1] == prefix_of(5)     # a new round: its next one counted
        waiting.forget()
        waiting.get(4)
        assert len(asked) == 5
    finally:
        waiting.close()

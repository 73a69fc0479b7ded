"""What one rendezvous round costs etcd, counted by etcd itself: it must grow linearly with the nodes.

torch's single-key rendezvous makes every joiner rewrite the whole group
(O(N²) bytes, and compare-and-swap retries on top); the per-round keys of
``marind.rendezvous.rounds`` make it O(N). This test reads etcd's own
counters (``/metrics`` of a private etcd) around one round of N in-process
handlers (threads) for two small N and fails when requests, writes, bytes
written or bytes sent to the torchruns grow faster than N. The last caught
the closed round's participants list that every joiner's watch received
(N² bytes a round: 4 -> 32 nodes sent 13.1x the bytes, where rank keys send
8.1x). No timing is asserted.

``round_cost(endpoint, n, make)`` is also how the figures in docs/perf.md
("Rendezvous") were taken, for this handler and for the earlier one
(``marind.rendezvous.create_state_handler``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from marind.rendezvous import create_etcd3_handler, create_state_handler
from marind.testing.etcd_metrics import etcd_counters

SMALL, LARGE = 4, 32
#: the most a figure may grow from SMALL to LARGE nodes: linear, with 20 % slack
LIMIT = LARGE / SMALL * 1.2


def round_cost(endpoint: str, n: int, make: Callable[[RendezvousParameters], RendezvousHandler]
               = create_etcd3_handler) -> dict[str, float]:
    """etcd's counters moved by ``n`` handlers made with ``make`` joining one round of ``n:n`` nodes.

    Counts from before the handlers connect until every one has its rank.
    """
    # keep-alives are work per second, not per round: none falls inside a round here
    params = RendezvousParameters("etcd3", endpoint, f"cost-{uuid.uuid4().hex[:8]}", n, n,
                                  prefix=f"/cost-{uuid.uuid4().hex[:6]}", join_timeout="120",
                                  last_call_timeout="30", keep_alive_interval="60")
    before = etcd_counters(endpoint)
    handlers = [make(params) for _ in range(n)]
    errors: list = []

    def join(handler: RendezvousHandler) -> None:
        try:
            handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    after = etcd_counters(endpoint)
    for handler in handlers:
        handler._stop_heartbeats()            # type: ignore[attr-defined]  # both handlers have it
    assert not errors and not any(t.is_alive() for t in threads), errors[:3]
    return {k: after[k] - before[k] for k in after}


def test_one_rounds_requests_and_writes_grow_linearly(etcd_private):
    small = round_cost(etcd_private.endpoint, SMALL)
    large = round_cost(etcd_private.endpoint, LARGE)
    print(f"\netcd counters for one round: {SMALL} nodes {small}\n{LARGE} nodes {large}")
    for figure in ("requests", "writes", "wal_bytes", "bytes_in", "bytes_out"):
        assert large[figure] <= small[figure] * LIMIT, (figure, small, large)


def test_the_count_tells_the_single_key_handler_apart(etcd_private):
    """The same count on torch's single-key handler (marind's earlier one): its bytes written grow
    faster than N, so the test above would catch a return to it."""
    large_n = LARGE                              # far enough apart that N² stands out of fixed costs
    small = round_cost(etcd_private.endpoint, SMALL, create_state_handler)
    large = round_cost(etcd_private.endpoint, large_n, create_state_handler)
    print(f"\nsingle-key handler, one round: {SMALL} nodes {small}\n{large_n} nodes {large}")
    assert large["wal_bytes"] > small["wal_bytes"] * large_n / SMALL * 1.2, (small, large)

"""Riding out a short etcd outage: retry ``ControlPlaneUnavailable`` for a grace window.

A control-plane blip (etcd restarted, a leader election, a network hiccup
of a few seconds) must not end a running job: torch's agent calls the
rendezvous backend from its monitor loop (``num_nodes_waiting``), its
keep-alive thread and ``shutdown``, and a ``RendezvousConnectionError``
from the monitor loop or shutdown makes torchrun exit 1 with no restart.
``with_grace`` retries a call with capped exponential backoff until it
succeeds or ``grace`` seconds have passed since the first failure, and
only then raises the last ``ControlPlaneUnavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from marind.core.errors import ControlPlaneRefused, ControlPlaneUnavailable
from marind.core.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

DEFAULT_GRACE = 30.0
_FIRST_DELAY, _MAX_DELAY = 0.1, 2.0


def backoff_delays(first: float = _FIRST_DELAY, cap: float = _MAX_DELAY):
    """0.1, 0.2, 0.4, ... capped at ``cap`` seconds (pure)."""
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * 2)


def with_grace(fn: Callable[[], T], grace: float, what: str) -> T:
    """``fn()``, retried on ControlPlaneUnavailable until ``grace`` seconds after the first failure
    (a request etcd refused for what it is, ``ControlPlaneRefused``, is raised at once)."""
    deadline = None
    delays = backoff_delays()
    while True:
        try:
            return fn()
        except ControlPlaneRefused:
            raise
        except ControlPlaneUnavailable as exc:
            now = time.monotonic()
            if deadline is None:
                deadline = now + grace
                log.warning("etcd_unavailable_retrying", op=what, grace_s=grace, error=str(exc))
            if now >= deadline:
                raise
            time.sleep(min(next(delays), max(0.0, deadline - now)))

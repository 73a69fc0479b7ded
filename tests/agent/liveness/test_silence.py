"""A silent host declared lost before its lease expires (marind/agent/liveness/silence.py), and why that is safe."""

from __future__ import annotations

import itertools
import math

import pytest

from marind.agent.decisions import LossAction, fence_due
from marind.agent.liveness.silence import (
    HOST_SILENT,
    PROBE_SILENT_S,
    STALL_S,
    on_silent_peer,
    silent_peer,
    stall_for,
    suspect,
    unrenewed_for,
)
from marind.core.lease_file import commit_margin, renew_interval, silent_window

TTL = 10


@pytest.mark.unit
def test_a_peer_is_suspect_only_after_its_probes_failed_for_a_while():
    assert not suspect(None, 100.0)
    assert not suspect(100.0, 100.0 + PROBE_SILENT_S - 0.01)
    assert suspect(100.0, 100.0 + PROBE_SILENT_S)


@pytest.mark.unit
def test_the_time_since_the_last_renewal_is_a_lower_bound():
    # etcd truncates: 7 reported of a 10 s lease means 7 <= left < 8, so more than 2 s passed
    assert unrenewed_for(7, 10) == 2.0
    assert unrenewed_for(9, 10) == 0.0


@pytest.mark.unit
def test_silent_needs_both_signals():
    window = silent_window(TTL)
    now = 200.0
    ok, why = silent_peer(down_since=None, now=now, lease=(2, TTL), window=window)
    assert not ok and "answers" in why                                  # lease stale, data fine: etcd alone
    ok, why = silent_peer(down_since=now - 5, now=now, lease=(9, TTL), window=window)
    assert not ok and "renewed less than" in why                        # data silent, lease fresh: data alone
    ok, why = silent_peer(down_since=now - 5, now=now, lease=(TTL - 1 - math.ceil(window), TTL), window=window)
    assert ok and "unrenewed for more than" in why and "silent for 5.0s" in why
    ok, why = silent_peer(down_since=now - 5, now=now, lease=None, window=window)
    assert ok and "lease is gone" in why
    ok, _ = silent_peer(down_since=now - 0.5, now=now, lease=None, window=window)
    assert not ok                                                       # one failed probe is not silence


@pytest.mark.unit
def test_a_declared_host_can_no_longer_commit():
    """Whenever a peer may declare the host lost, the host's commit window (lease.json) is over.

    The host renews by sending at ``sent``; etcd refreshes the lease at ``sent + d`` (d >= 0). A peer
    asks etcd at ``t`` and hears ``floor(left)``; the host's lease file says ``valid_until = sent +
    window`` and a commit needs ``commit_margin`` of it left.
    """
    window = silent_window(TTL)
    for sent, d, wait in itertools.product((1000.0, 1000.37), (0.0, 0.004, 0.3, 0.999), [x / 20 for x in range(0, 200)]):
        refreshed, t = sent + d, sent + d + wait
        left = TTL - (t - refreshed)
        reported = math.floor(left) if left >= 0 else None
        lease = (reported, TTL) if reported is not None else None
        declared, _ = silent_peer(down_since=t - 5, now=t, lease=lease, window=window)
        if declared:
            assert sent + window - t < commit_margin(TTL), (sent, d, wait)
            assert sent + window <= t, (sent, d, wait)


@pytest.mark.unit
def test_renewals_come_often_enough_for_a_live_host_to_commit():
    for ttl in (2, 6, 10, 30):
        assert renew_interval(ttl) < silent_window(ttl) - commit_margin(ttl), ttl


@pytest.mark.unit
@pytest.mark.parametrize(("kw", "action", "text"), [
    ({"torchft": True}, LossAction.MARK, "torchft"),
    ({"in_round": False}, LossAction.MARK, "no workers"),
    ({"workers_running": False}, LossAction.MARK, "not running"),
    ({"progress_at": 99.5}, LossAction.WAIT, "training goes on"),
    ({"progress_at": 95.0}, LossAction.RESTART, "no progress for 5.0s"),
    ({"progress_at": None}, LossAction.RESTART, "no progress seen yet"),
])
def test_what_a_survivor_does(kw, action, text):
    args = {"in_round": True, "workers_running": True, "progress_at": 95.0, "now": 100.0, "torchft": False} | kw
    got, why = on_silent_peer(**args)
    assert got == action and text in why, why


@pytest.mark.unit
def test_a_revoked_lease_fences_even_stepping_workers():
    fence, why = fence_due(last_renewal=100.0, ttl=TTL, now=103.0, progress_at=102.9, stall_s=5, revoked=True)
    assert fence and "revoked" in why
    fence, _ = fence_due(last_renewal=100.0, ttl=TTL, now=103.0, progress_at=102.9, stall_s=5)
    assert not fence


@pytest.mark.unit
def test_the_cause_has_its_own_name():
    assert HOST_SILENT == "host_silent"


@pytest.mark.unit
def test_slow_steps_need_a_longer_stall():
    assert stall_for(None) == STALL_S and stall_for(0.3) == STALL_S
    assert stall_for(12.0) == 24.0                   # 12 s steps: 2 s without progress is no evidence
    action, _ = on_silent_peer(in_round=True, workers_running=True, progress_at=90.0, now=100.0, torchft=False,
                               stall_s=stall_for(12.0))
    assert action == LossAction.WAIT

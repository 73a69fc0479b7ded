"""When a rank gives up a cross-group collective: the lighthouse status page, the decision, the wait.

The last test reads a real torchft lighthouse's page, so a torchft that changes it fails here.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from marind.trainer.ft.abort import (
    LighthouseView,
    SilentPeerWatch,
    decide_abort,
    decide_late,
    parse_status,
    read_status,
)

PAGE = """
Current quorum_id: 7 <br>
Next quorum status: New quorum not ready [1/1 participants healthy][2 heartbeating][shrink_only=false]
<h3>Previous Quorum</h3>
Previous quorum id: 7 <br>
Num participants: 2 <br>
<div class="member
 ">
  <b>job_rg0:aaaa</b> <br/>
  Step: 3 <br/>
</div>
<div class="member
 ">
  <b>job_rg1:bbbb</b> <br/>
  Step: 3 <br/>
</div>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
    old
  ">
    job_rg1:bbbb: seen 6.25s ago
  </li>
  <li class="heartbeat
  ">
    job_rg0:aaaa: seen 0.001130082s ago
  </li>
  <li class="heartbeat old">
    job_rg2:cccc: seen 1.5e2s ago
  </li>
</ul>
"""

MEMBERS = ("job_rg0:aaaa", "job_rg1:bbbb")


@pytest.mark.unit
def test_the_status_page_gives_the_latest_quorum_and_every_heartbeat_age():
    view = parse_status(PAGE)
    assert view.quorum_id == 7 and view.members == MEMBERS
    assert view.heartbeats == {"job_rg1:bbbb": 6.25, "job_rg0:aaaa": 0.001130082, "job_rg2:cccc": 150.0}
    assert parse_status("<html>a lighthouse before its first quorum</html>") == LighthouseView(None, (), {})


@pytest.mark.unit
@pytest.mark.parametrize("members, beats, epoch_now, abort, why", [
    (MEMBERS, {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 0.2}, 3, False, "every member heartbeats"),
    (MEMBERS, {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 2.5}, 3, True, "replica job_rg1:bbbb silent for 2.5s"),
    (MEMBERS, {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 2.0}, 3, False, "every member heartbeats"),   # not past it yet
    (MEMBERS, {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 0.2, "job_rg2:old": 900.0}, 3, False, "every member"),
    (MEMBERS, {"job_rg0:aaaa": 0.1}, 3, False, "every member heartbeats"),   # a member the page lacks: unknown
    (MEMBERS, None, 3, False, "lighthouse status unreadable"),
    (None, {"job_rg1:bbbb": 9.0}, 3, False, "not the lighthouse's latest"),
    (MEMBERS, None, 4, True, "lighthouse moved (epoch 3 -> 4)"),
    (MEMBERS, None, -1, False, "lighthouse status unreadable"),          # no lighthouse file: epoch unknown
])
def test_abort_only_for_a_silent_member_of_this_quorum_or_a_moved_lighthouse(members, beats, epoch_now, abort, why):
    d = decide_abort(members, beats, heartbeat_timeout=2.0, epoch=3, epoch_now=epoch_now)
    assert d.abort is abort and why in d.reason


@pytest.mark.unit
@pytest.mark.parametrize("latest, pending, abort", [
    (7, 9.0, False),      # still this rank's quorum: the others waited for it
    (8, 9.0, True),       # a newer quorum formed while it was pending: the others went on without it
    (8, 1.0, False),      # quick: never checked
    (None, 9.0, False),   # lighthouse unreadable: decides nothing
])
def test_a_late_completion_is_not_committed_once_the_others_went_on(latest, pending, abort):
    d = decide_late(latest, 7, pending, heartbeat_timeout=2.0)
    assert d.abort is abort
    if abort:
        assert "quorum 8 formed without this group" in d.reason


class _Lighthouse:
    """Stands in for the HTTP read: the views a lighthouse would show, one per read."""

    def __init__(self, *views):
        self.views, self.reads = list(views), 0

    def __call__(self, address):
        self.reads += 1
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


class _Clock:
    """A clock that a collective's wait advances by the seconds it waited (no real sleeping)."""

    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now

    def waiting(self, *results):
        """A ``wait_done`` that waits its slice and gives ``results`` in turn (the last one from then on)."""
        results = list(results)

        def wait_done(seconds):
            self.now += seconds
            return results.pop(0) if len(results) > 1 else results[0]
        return wait_done


def _watch(lighthouse, quorum_id=7, epoch=3, clock=None, epoch_now=None):
    return SilentPeerWatch("http://lh", 2.0, epoch, epoch_now or (lambda: epoch), lambda: quorum_id, read=lighthouse,
                           clock=clock or _Clock())


@pytest.mark.unit
def test_a_collective_that_ends_is_never_given_up_and_reads_nothing_when_quick():
    lh = _Lighthouse(LighthouseView(7, MEMBERS, {"job_rg1:bbbb": 99.0}))
    assert not _watch(lh).wait(lambda s: True).abort
    assert lh.reads == 0
    clock = _Clock()
    lh = _Lighthouse(LighthouseView(7, MEMBERS, {"job_rg1:bbbb": 0.1}))
    # pending 2.25 s in slices of 0.25 s: a read after 1 s and one after 2 s, peers alive; then, the step
    # longer than heartbeat_timeout, the late check's read (the lighthouse's quorum is still this one)
    d = _watch(lh, clock=clock).wait(clock.waiting(*[False] * 8, True))
    assert d.reason == "completed" and lh.reads == 3


@pytest.mark.unit
def test_a_member_that_goes_silent_ends_the_wait_and_members_outlive_a_newer_quorum():
    alive = LighthouseView(7, MEMBERS, {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 1.0})
    # the lighthouse's latest quorum becomes 8 (a joiner alone); ours stays 7, remembered from the first read
    later = LighthouseView(8, ("job_rg3:dddd",), {"job_rg0:aaaa": 0.1, "job_rg1:bbbb": 3.1})
    clock = _Clock()
    watch = _watch(_Lighthouse(alive, later), clock=clock)
    d = watch.wait(clock.waiting(False))
    assert d.abort and "job_rg1:bbbb silent for 3.1s" in d.reason and watch.aborts == 1
    assert clock.now == 102.0       # read at 1 s (alive) and 2 s (silent)


@pytest.mark.unit
def test_a_moved_lighthouse_ends_the_wait_within_a_slice_without_reading_the_old_one():
    clock, epoch = _Clock(), [3]
    lh = _Lighthouse(None)         # the old lighthouse's host is gone: a read would wait out its timeout

    def wait_done(seconds):
        clock.now += seconds
        if clock.now >= 101.3:
            epoch[0] = 4           # the agent elected a new lighthouse
        return False

    watch = _watch(lh, clock=clock, epoch_now=lambda: epoch[0])
    d = watch.wait(wait_done)
    assert d.abort and "lighthouse moved (epoch 3 -> 4)" in d.reason
    assert clock.now == 101.5 and lh.reads == 1     # seen in the slice it moved in; the old one read once (at 1 s)


@pytest.mark.unit
def test_a_collective_that_ends_after_a_freeze_is_checked_once_more():
    now = [100.0]
    frozen = iter([True])

    def wait_done(seconds):
        now[0] += 10.0                          # the process was stopped 10 s inside this wait
        return next(frozen)

    lh = _Lighthouse(LighthouseView(8, ("job_rg0:aaaa",), {"job_rg0:aaaa": 0.1}))
    watch = SilentPeerWatch("http://lh", 2.0, 3, lambda: 3, lambda: 7, read=lh, clock=lambda: now[0])
    d = watch.wait(wait_done)
    assert d.abort and "quorum 8 formed without this group" in d.reason and lh.reads == 1


@pytest.mark.unit
def test_a_step_frozen_before_its_collective_is_checked_when_the_collective_ends_at_once():
    now = [100.0]
    lh = _Lighthouse(LighthouseView(8, ("job_rg0:aaaa",), {"job_rg0:aaaa": 0.1}))
    watch = SilentPeerWatch("http://lh", 2.0, 3, lambda: 3, lambda: 7, read=lh, clock=lambda: now[0])
    assert not watch.wait(lambda s: True, since=99.0).abort and lh.reads == 0     # a quick step reads nothing
    d = watch.wait(lambda s: True, since=90.0)                                  # quorum 10 s ago
    assert d.abort and "quorum 8 formed without this group" in d.reason and lh.reads == 1


@pytest.mark.unit
def test_an_unknown_quorum_waits_for_the_collective():
    clock = _Clock()
    lh = _Lighthouse(LighthouseView(9, ("job_rg5:eeee",), {"job_rg1:bbbb": 50.0}))
    # pending 3 s (three reads): never given up while it waits, whatever the heartbeats of an unknown quorum say;
    # once it ends, the late check sees that quorum 9 formed meanwhile: not committed
    d = _watch(lh, quorum_id=7, clock=clock).wait(clock.waiting(*[False] * 12, True))
    assert clock.now == 103.25 and lh.reads == 4 and "quorum 9 formed without this group" in d.reason


def test_a_real_lighthouse_page_parses():
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient, LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=10000)
    try:
        address = lh.address()
        client = LighthouseClient(address, timedelta(seconds=5))
        client.heartbeat("job_rg0:aaaa")
        client.quorum("job_rg0:aaaa", timedelta(seconds=30), address="a0", store_address="s0", step=3, world_size=1,
                      shrink_only=False)
        time.sleep(0.3)
        client.heartbeat("job_rg1:bbbb")        # heartbeats, not a member
        view = read_status(address)
        assert view is not None and view.quorum_id is not None and view.members == ("job_rg0:aaaa",)
        assert view.heartbeats["job_rg0:aaaa"] > view.heartbeats["job_rg1:bbbb"] >= 0
    finally:
        lh.shutdown()
    # gone: unreadable, decides nothing (the server stops its listener a moment after shutdown returns)
    deadline = time.monotonic() + 10
    while read_status(address) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_status(address) is None

"""The lease file that fences a replaced world's checkpoint commit (marind/core/lease_file.py)."""

from __future__ import annotations

import pytest

from marind.core.lease_file import (
    COMMIT_MARGIN_S,
    commit_allowed,
    commit_margin,
    lease_path,
    read_lease,
    read_lease_doc,
    save_held,
    write_lease,
)


@pytest.mark.unit
def test_a_commit_needs_lease_time_left():
    ok, why = commit_allowed(110.0, 100.0)
    assert ok and "10.0s" in why
    assert commit_allowed(100.0 + COMMIT_MARGIN_S, 100.0)[0] is True
    ok, why = commit_allowed(100.0 + COMMIT_MARGIN_S - 0.01, 100.0)
    assert not ok and "replaced" in why
    assert commit_allowed(50.0, 100.0)[0] is False           # a stale world, back from a freeze


@pytest.mark.unit
def test_no_lease_file_allows_a_run_without_an_agent():
    assert commit_allowed(None, 100.0) == (True, "no lease file: not run by a marind agent")


@pytest.mark.unit
def test_the_file_round_trips_and_a_bad_one_reads_as_absent(tmp_path):
    assert read_lease(tmp_path) is None
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a")
    assert read_lease(tmp_path) == 1004.0              # the last renewal + the silent window (0.4 TTL)
    lease_path(tmp_path).write_text('{"valid_until": "soon"}')
    assert read_lease(tmp_path) is None
    lease_path(tmp_path).write_text("not json")
    assert read_lease(tmp_path) is None


@pytest.mark.unit
def test_the_margin_is_at_most_half_the_window():
    assert commit_margin(10) == COMMIT_MARGIN_S and commit_margin(5) == 1.0 and commit_margin(2) == 0.4


@pytest.mark.unit
def test_a_data_network_fence_ends_the_lease_early_and_a_save_refuses(tmp_path):
    from ckpt_store.errors import CheckpointSaveFailed
    from ckpt_store.save.fence import check_fence
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a", until=1003.0)
    assert read_lease(tmp_path) == 1003.0
    with pytest.raises(CheckpointSaveFailed, match="replaced"):
        check_fence((str(lease_path(tmp_path)), COMMIT_MARGIN_S), now=1002.5)
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a", until=2000.0)    # never past the window
    assert read_lease(tmp_path) == 1004.0
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a")                  # lifted
    check_fence((str(lease_path(tmp_path)), COMMIT_MARGIN_S), now=1002.0)


@pytest.mark.unit
def test_a_due_save_is_held_while_the_lease_is_late_or_commits_are_fenced(tmp_path):
    assert save_held(read_lease_doc(tmp_path), 1000.0) is None              # no agent: save
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a")
    assert save_held(read_lease_doc(tmp_path), 1004.9) is None              # renewals due every second
    assert "not being renewed" in save_held(read_lease_doc(tmp_path), 1005.1)   # past half the TTL
    write_lease(tmp_path, renewed_at=1000.0, ttl=10, node="a", until=999.0)    # no data-network peer answers
    assert "fenced" in save_held(read_lease_doc(tmp_path), 1000.5)
    write_lease(tmp_path, renewed_at=1001.0, ttl=10, node="a")                  # lifted
    assert save_held(read_lease_doc(tmp_path), 1001.5) is None
    lease_path(tmp_path).write_text('{"renewed_at": "soon", "ttl": 10}')
    assert save_held(read_lease_doc(tmp_path), 1001.5) is None              # malformed: as without an agent


def test_a_commit_waits_for_a_renewal_that_is_due(tmp_path):
    """A short lease file is re-read: the renewal that comes meanwhile lets the commit through."""
    import threading
    import time

    from ckpt_store.save.fence import check_fence
    write_lease(tmp_path, renewed_at=time.time() - 3.5, ttl=10, node="a")    # 0.5 s left, margin 1 s
    renew = threading.Timer(0.3, lambda: write_lease(tmp_path, renewed_at=time.time(), ttl=10, node="a"))
    renew.start()
    try:
        check_fence((str(lease_path(tmp_path)), COMMIT_MARGIN_S))
    finally:
        renew.cancel()


def test_a_commit_without_a_renewal_fails_after_waiting(tmp_path):
    import time

    from ckpt_store.errors import CheckpointSaveFailed
    from ckpt_store.save.fence import check_fence
    write_lease(tmp_path, renewed_at=time.time() - 1.9, ttl=5, node="a")     # window 2 s, margin 0.5 s
    with pytest.raises(CheckpointSaveFailed, match="replaced"):
        check_fence((str(lease_path(tmp_path)), COMMIT_MARGIN_S))

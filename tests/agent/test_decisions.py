"""The agent's decision functions (marind/agent/decisions.py): plain data in, decision and reason out."""

from __future__ import annotations

import pytest

from marind.agent.decisions import (
    HANG_DUMP_WAIT_S,
    RESTART_RUNNING_FALLBACK_S,
    SUCCESS_GRACE_S,
    Admission,
    ExitAction,
    Generation,
    HangAction,
    admit,
    after_exit,
    after_group_failure,
    classify_workers,
    on_hang,
    on_terminal_state,
    replica_group_lost,
    workers_running,
)
from marind.control.lifecycle import JobState

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("nproc, used, slots, expected", [
    (2, 0, 4, Admission.START),
    (4, 0, 4, Admission.START),
    (2, 2, 4, Admission.START),
    (2, 3, 4, Admission.WAIT),
    (4, 1, 4, Admission.WAIT),
    (5, 0, 4, Admission.TOO_BIG),
    (5, 4, 4, Admission.TOO_BIG),     # too big wins over busy: it never fits here
])
def test_admit(nproc, used, slots, expected):
    verdict, why = admit(nproc, used, slots)
    assert verdict == expected and why
    if expected == Admission.TOO_BIG:
        assert f"the node has {slots}" in why


def test_a_job_failed_or_cancelled_elsewhere_stops_at_once():
    for state in (JobState.FAILED, JobState.CANCELLED):
        d = on_terminal_state(state, torchrun_running=True, terminal_since=None, now=100.0)
        assert d.end and d.reason == f"job is {state.value}" and d.terminal_since is None


def test_a_job_succeeded_elsewhere_gets_a_grace_period_while_torchrun_runs():
    d = on_terminal_state(JobState.SUCCEEDED, torchrun_running=True, terminal_since=None, now=100.0)
    assert not d.end and d.terminal_since == 100.0 and "SUCCEEDED elsewhere" in d.reason
    d = on_terminal_state(JobState.SUCCEEDED, torchrun_running=True, terminal_since=100.0,
                          now=100.0 + SUCCESS_GRACE_S - 0.1)
    assert not d.end and d.terminal_since == 100.0
    d = on_terminal_state(JobState.SUCCEEDED, torchrun_running=True, terminal_since=100.0,
                          now=100.0 + SUCCESS_GRACE_S)
    assert d.end and d.reason == "job is SUCCEEDED" and d.terminal_since == 100.0
    d = on_terminal_state(JobState.SUCCEEDED, torchrun_running=False, terminal_since=None, now=100.0)
    assert d.end and d.terminal_since is None


def test_classify_workers_tells_rounds_apart():
    none: frozenset[int] = frozenset()
    assert classify_workers(none, none)[:2] == (Generation.SAME, none)
    assert classify_workers(frozenset({1, 2}), none)[:2] == (Generation.NEW, frozenset({1, 2}))
    assert classify_workers(frozenset({1}), frozenset({1, 2}))[:2] == (Generation.SAME, frozenset({1, 2}))
    assert classify_workers(frozenset({2, 3}), frozenset({1, 2}))[:2] == (Generation.SPAWNING, frozenset({1, 2, 3}))
    verdict, known, why = classify_workers(frozenset({7, 8}), frozenset({1, 2}))
    assert (verdict, known) == (Generation.NEW, frozenset({7, 8})) and "previous round" in why


def test_workers_running_after_a_report_or_the_fallback():
    assert workers_running(["starting", "training"], awaiting_since=0.0, now=1.0)[0]
    assert workers_running(["done"], awaiting_since=0.0, now=1.0)[0]
    assert not workers_running(["starting", "restoring"], awaiting_since=0.0, now=1.0)[0]
    assert not workers_running([], awaiting_since=0.0, now=RESTART_RUNNING_FALLBACK_S)[0]
    running, why = workers_running([], awaiting_since=0.0, now=RESTART_RUNNING_FALLBACK_S + 0.1)
    assert running and "no training report" in why


def test_exit_zero_succeeds_and_nonzero_fails():
    d = after_exit(0, node="n1", job="j", etcd_down=False, etcd_retries=0, max_restarts=3)
    assert (d.action, d.reason, d.etcd_retries) == (ExitAction.SUCCEED, "torchrun exited 0 on n1", 0)
    d = after_exit(1, node="n1", job="j", etcd_down=False, etcd_retries=2, max_restarts=3)
    assert d.action == ExitAction.FAIL and d.etcd_retries == 2
    assert d.reason == ("torchrun exited 1 on n1 (restarts exhausted or the entrypoint failed); "
                        "see `marind logs j`")


def test_exit_while_etcd_is_away_retries_up_to_max_restarts():
    retries = 0
    for attempt in range(1, 4):
        d = after_exit(1, node="n", job="j", etcd_down=True, etcd_retries=retries, max_restarts=3)
        assert (d.action, d.etcd_retries) == (ExitAction.RETRY, attempt)
        assert d.reason == "etcd unreachable: torchrun exited"
        retries = d.etcd_retries
    d = after_exit(1, node="n", job="j", etcd_down=True, etcd_retries=retries, max_restarts=3)
    assert (d.action, d.etcd_retries) == (ExitAction.FAIL, 4)
    d = after_exit(0, node="n", job="j", etcd_down=True, etcd_retries=0, max_restarts=3)
    assert d.action == ExitAction.SUCCEED and d.etcd_retries == 0      # a clean exit is never etcd's fault
    d = after_exit(1, node="n", job="j", etcd_down=True, etcd_retries=0, max_restarts=0)
    assert d.action == ExitAction.FAIL


def test_a_failed_replica_group_leaves_only_when_others_train_on():
    assert after_group_failure(["b", "c"]) == (True, "the other groups train on (b, c)")
    leave, why = after_group_failure([])
    assert not leave and "no other node" in why
    leave, why = after_group_failure(None)
    assert not leave and "cannot count" in why


def test_hang_dump_then_kill_after_the_wait():
    assert on_hang(now=0.0, hung=False, why="progress 1s ago", kill_at=None, torchrun_exited=False) == \
        (HangAction.NONE, "progress 1s ago")
    assert on_hang(now=0.0, hung=True, why="no progress", kill_at=None, torchrun_exited=False) == \
        (HangAction.DUMP, "no progress")
    kill_at = 10.0 + HANG_DUMP_WAIT_S
    assert on_hang(now=10.5, hung=False, why="", kill_at=kill_at, torchrun_exited=False)[0] == HangAction.WAIT
    assert on_hang(now=10.5, hung=True, why="", kill_at=kill_at, torchrun_exited=False)[0] == HangAction.WAIT
    assert on_hang(now=kill_at, hung=False, why="", kill_at=kill_at, torchrun_exited=False)[0] == HangAction.KILL
    action, why = on_hang(now=10.1, hung=False, why="", kill_at=kill_at, torchrun_exited=True)
    assert action == HangAction.KILL and "torchrun exited" in why


def test_replica_group_lost():
    assert replica_group_lost(1, 1, stopping=False)[0] is False
    assert replica_group_lost(None, 1, stopping=True)[0] is False
    assert replica_group_lost(None, 1, stopping=False) == (True, "replica group slot 1 lost; now none")
    assert replica_group_lost(0, 1, stopping=False) == (True, "replica group slot 1 lost; now 0")

"""The goodput ledger on hand-written histories: each cause where it belongs, parts summing to the wall time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from marind.control import goodput_ledger as gl
from marind.control.goodput_ledger import LedgerState, Sample
from marind.core.progress import ProgressRecord, add_phase_time

pytestmark = pytest.mark.unit


def ev(at: float, kind: str, seq: int) -> dict:
    return {"at": at, "kind": kind, "seq": seq, "node": "n1", "detail": {}}


def train(gen: str, t0: float, t1: float, step0: int, round_at: float | None = None) -> list[Sample]:
    """Samples once a second from t0 to t1, a step each second from step0."""
    out = [Sample(t0, step0, "starting", gen, round_at), Sample(t0 + 1, step0, "restoring", gen)]
    step = step0
    t = t0 + 2
    while t <= t1:
        step += 1
        out.append(Sample(t, step, "training", gen))
        t += 1
    return out


def assert_sums(ledger: dict) -> None:
    assert abs(sum(ledger["seconds"].values()) - ledger["wall_s"]) < 0.01, ledger


def test_a_clean_run_is_waiting_startup_restore_training_and_shutdown():
    events = [ev(100, "submitted", 1), ev(103, "node_joined", 2), ev(150, "succeeded", 3)]
    samples = train("p1", 106, 140, 0, round_at=105) + [Sample(141, 35, "done", "p1")]
    ledger = gl.compute(events, samples, now=500)
    s = ledger["seconds"]
    assert ledger["wall_s"] == 50 and ledger["final"]
    # each interval belongs to what the record before it announced: starting (106), restoring (107)
    assert s["waiting"] == 3 and s["rendezvous"] == 2 and s["startup"] == 1 + 1 and s["restore"] == 1
    assert s["training"] == 33 and s["shutdown"] == 9       # the done record at 141, the end at 150
    assert s["recompute"] == s["detection"] == s["hang"] == 0
    assert_sums(ledger)


def test_a_kill_is_detection_rendezvous_restart_restore_and_recompute():
    events = [ev(0, "submitted", 1), ev(0, "node_joined", 2),
              ev(22.5, "restart", 3),                       # last step at 20, noticed 2.5 s later
              ev(60, "succeeded", 4)]
    first = train("p1", 1, 20, 0, round_at=0.5)             # steps 1..18 at 3..20 (the first: restore)
    second = [Sample(26, 10, "starting", "p2", round_at=25), Sample(28, 10, "restoring", "p2")]
    second += [Sample(28 + i, 10 + i, "training", "p2") for i in range(1, 20)]   # steps 11..29 at 29..47
    ledger = gl.compute(events, first + second, now=99)
    s = ledger["seconds"]
    assert s["detection"] == 2.5
    assert s["rendezvous"] == 0.5 + 2.5                     # the first round's close, then 22.5 -> 25
    assert s["startup"] == 0.5 + 1 and s["restart"] == 1 + 2 and s["restore"] == 1 + 1
    assert s["recompute"] == 7                               # steps 12..18 again (11: the restore's)
    assert s["training"] == 17 + 11 and s["shutdown"] == 60 - 47
    assert_sums(ledger)


def test_a_hang_charges_the_stall_to_hang():
    samples = train("p1", 0, 10, 0) + [Sample(10 + i, 9, "training", "p1") for i in range(1, 30)]
    events = [ev(0, "node_joined", 1), ev(40, "hang_detected", 2), ev(42, "restart", 3)]
    state = gl.fold(LedgerState(), events, samples)
    ledger = gl.close(state, now=42)
    assert ledger["seconds"]["hang"] == 30 and ledger["seconds"]["training"] == 8
    assert ledger["seconds"]["rendezvous"] == 2
    assert_sums(ledger)


def test_time_held_back_is_shown_in_the_current_mode_and_settled_later():
    state = gl.fold(LedgerState(), [ev(0, "node_joined", 1)], train("p1", 0, 10, 0) +
                    [Sample(11, 9, "training", "p1"), Sample(12, 9, "training", "p1")])
    view = gl.close(state, now=12.5)
    assert view["seconds"]["training"] == 8 + 2.5 and not view["final"]
    assert_sums(view)
    gl.fold(state, [], [Sample(13, 10, "training", "p1")])
    assert gl.close(state, now=13)["seconds"]["training"] == 11


def test_a_power_off_seen_by_another_node_and_the_state_taken_over():
    """One agent folds, stores the state, another reads it back and goes on (rank 0 moved)."""
    state = gl.fold(LedgerState(), [ev(0, "node_joined", 1)], train("p1", 0, 20, 0))
    stored = LedgerState.from_dict(state.to_dict())
    events = [ev(0, "node_joined", 1), ev(31, "node_lost", 2), ev(31.2, "restart", 3)]
    second = train("q7", 40, 50, 15, round_at=38)
    gl.fold(stored, events, second)
    s = gl.close(stored, now=50)["seconds"]
    assert s["detection"] == 11 and s["rendezvous"] == 7 and s["restart"] == 2 + 1 and s["restore"] == 1 + 1
    assert s["recompute"] == 3 and s["training"] == 18 + 5


def test_a_checkpoint_phase_and_a_late_event():
    samples = train("p1", 0, 5, 0) + [Sample(6, 4, "checkpointing", "p1"), Sample(8, 5, "training", "p1")]
    events = [ev(0, "node_joined", 1), ev(9, "succeeded", 3), ev(7, "checkpoint_committed", 2)]
    ledger = gl.compute(events, samples, now=100)
    # from the record in phase checkpointing to the next one
    assert ledger["seconds"]["checkpoint"] == 2 and ledger["seconds"]["training"] == 4 and ledger["wall_s"] == 9
    assert_sums(ledger)


def test_events_folded_twice_count_once_and_a_broken_state_starts_afresh():
    state = gl.fold(LedgerState(), [ev(0, "node_joined", 1), ev(5, "restart", 2)], train("p1", 0, 4, 0))
    before = state.to_dict()
    gl.fold(state, [ev(5, "restart", 2)], [])
    assert state.to_dict() == before
    assert LedgerState.from_dict({"seconds": "x"}).start is None
    assert LedgerState.from_dict(None).seconds == {}
    assert gl.close(LedgerState(), now=5)["goodput"] is None


def test_summary_line_names_goodput_and_the_top_causes():
    ledger = gl.compute([ev(0, "node_joined", 1), ev(22.5, "restart", 2), ev(100, "cancelled", 3)],
                        train("p1", 0, 20, 0) + train("p2", 30, 90, 0, round_at=29), now=0)
    line = gl.summary_line(ledger, top=6)
    assert line.startswith("goodput ") and "detection" in line and "lost:" in line


def test_a_first_record_already_training_charges_the_wait_for_it_to_startup():
    events = [ev(0, "node_joined", 1)]
    samples = [Sample(10, 0, "training", "p1", round_at=4), Sample(11, 1, "training", "p1"),
               Sample(20, 5, "training", "p2", round_at=15), Sample(21, 6, "training", "p2")]
    ledger = gl.compute(events + [ev(14, "restart", 2)], samples, now=21)
    s = ledger["seconds"]
    assert s["rendezvous"] == 4 + 1 and s["startup"] == 6 and s["restart"] == 5 and s["detection"] == 3
    assert s["training"] == 1 + 1
    assert_sums(ledger)


def test_a_ledger_started_at_submission_counts_the_wait_for_nodes():
    stored = LedgerState(start=100, t=100, mode="waiting").to_dict()         # what `marind submit` writes
    state = gl.fold(LedgerState.from_dict(stored), [ev(130, "node_joined", 1)],
                    [Sample(140, 0, "training", "p1", round_at=135), Sample(141, 1, "training", "p1")])
    s = gl.close(state, now=141)["seconds"]
    assert s["waiting"] == 30 and s["rendezvous"] == 5 and s["startup"] == 5 and s["training"] == 1


def test_a_loss_only_marked_stops_nothing():
    events = [ev(0, "node_joined", 1), {"at": 5.5, "kind": "node_lost", "seq": 2, "detail": {"action": "mark"}}]
    ledger = gl.compute(events, train("p1", 0, 10, 0), now=10)
    assert ledger["seconds"]["detection"] == 0 and ledger["seconds"]["training"] == 8


# -- records that carry their process's phase times (``phase_s``) -------------------------------------
def process(gen: str, made_at: float, writes: list[tuple[float, str, int]], round_at: float | None = None) -> list[Sample]:
    """Every record one worker process writes, as ``ProgressWriter`` keeps its ``phase_s``: the process made
    its record at ``made_at`` (phase starting) and wrote ``(at, phase, step)`` in turn."""
    record = ProgressRecord(rank=0, local_rank=0, world_size=1, pid=1, step=0, loss=None, tokens_per_s=None,
                            last_checkpoint_step=None, phase="starting", updated_at=made_at, phase_s={})
    out = []
    for at, phase, step in writes:
        record = replace(record, phase=phase, step=step, updated_at=at, phase_s=add_phase_time(record, at, phase, step))
        out.append(Sample(at, step, phase, gen, round_at, phase_s=record.phase_s))   # the agent knows the round
    return out


def seen(samples: list[Sample], every: float, start: float, end: float) -> list[Sample]:
    """What an agent that looks every ``every`` seconds reads: the newest record at each look."""
    out: list[Sample] = []
    t = start
    while t <= end + 1e-9:
        newest = [s for s in samples if s.at <= t]
        if newest and (not out or newest[-1] is not out[-1]):
            out.append(newest[-1])
        t += every
    return out


def steps(t0: float, step0: int, n: int, dt: float, save_every: int = 0, save_s: float = 0.0):
    """``n`` steps of ``dt`` seconds from ``t0``; a save of ``save_s`` after every ``save_every``-th."""
    out, t = [], t0
    for step in range(step0 + 1, step0 + n + 1):
        t += dt
        out.append((t, "training", step))
        if save_every and step % save_every == 0:
            out.append((t, "checkpointing", step))
            t += save_s
            out.append((t, "training", step))
    return out, t


def test_saves_and_a_restore_shorter_than_a_report_are_charged_exactly():
    writes = [(11.0, "restoring", 0), (11.3, "training", 0)]
    more, end = steps(11.3, 0, 40, 0.2, save_every=5, save_s=0.15)       # 8 saves of 0.15 s
    records = process("p1", 10.0, writes + more + [(end + 0.5, "done", 40)], round_at=9.0)
    events = [ev(5, "node_joined", 1), ev(end + 2, "succeeded", 2)]
    ledger = gl.compute(events, seen(records, 1.0, 10.0, end + 1), now=end + 5)
    s = ledger["seconds"]
    assert s["restore"] == pytest.approx(0.3) and s["checkpoint"] == pytest.approx(8 * 0.15)
    assert s["training"] == pytest.approx(40 * 0.2) and s["startup"] == pytest.approx(1 + 1)   # spawn, starting
    assert s["rendezvous"] == 4 and s["shutdown"] == pytest.approx(0.5 + 1.5)       # last step -> done -> end
    assert_sums(ledger)
    # the agent that saw only the records it happened to read, without phase times: the saves go unseen
    bare = [replace(r, phase_s=None) for r in seen(records, 1.0, 10.0, end + 1)]
    assert gl.compute(events, bare, now=end + 5)["seconds"]["checkpoint"] < 8 * 0.15


def test_steps_redone_after_a_restart_are_recompute_in_proportion():
    first, t = steps(1.0, 0, 18, 0.25)
    second, t2 = steps(31.0, 10, 19, 0.25)                       # steps 11..29; 11..18 again
    samples = seen(process("p1", 0.5, first, round_at=0.2), 1.0, 0.5, t) + \
        seen(process("p2", 30.0, [(30.5, "restoring", 10), (31.0, "training", 10)] + second, round_at=29.0),
             1.0, 30.0, t2 + 1)
    events = [ev(0, "node_joined", 1), ev(t + 2, "restart", 2), ev(t2 + 1, "succeeded", 3)]
    s = gl.compute(events, samples, now=t2 + 1)["seconds"]
    # steps 11..18 again, the first run's first step its process's start-up (no record announced training before it)
    assert s["recompute"] == pytest.approx(8 * 0.25) and s["training"] == pytest.approx((17 + 11) * 0.25)
    assert s["restart"] == pytest.approx(1.0 + 0.5) and s["restore"] == pytest.approx(0.5)
    assert s["detection"] == pytest.approx(2.0)


def test_phase_times_survive_a_hand_over_and_an_event_between_samples_falls_back():
    records = process("p1", 0.0, [(1.0, "training", 0)] + steps(1.0, 0, 20, 0.3)[0])
    looks = seen(records, 1.0, 0.0, 7.0)
    state = gl.fold(LedgerState(), [ev(0, "node_joined", 1)], looks[:3])
    stored = LedgerState.from_dict(state.to_dict())
    assert stored.marks == looks[2].phase_s
    gl.fold(stored, [], looks[3:])
    assert gl.close(stored, now=looks[-1].at)["seconds"]["training"] == pytest.approx(looks[-1].at - 1.0)
    # a charge by an event in between: the next sample is charged as before, by what it announced
    gl.fold(stored, [ev(looks[-1].at + 0.1, "node_lost", 9)], [])
    assert stored.marks is None

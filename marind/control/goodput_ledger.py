"""Where a job's wall time went: the goodput ledger (docs/design.md §11, *the goodput ledger*).

A pure fold over the job's history, in time order: its events (``marind.control.events``:
``submitted``, ``node_joined``, ``restart``, ``node_lost``, ``hang_detected``, a terminal one...)
and samples of global rank 0's progress record (``Sample``: step, phase, which generation of
workers wrote it, when its rendezvous round closed). Every second from the job's submission to
its end (or now) is charged to exactly one cause (``CAUSES``), so the parts add up to the wall
time by construction:

* ``waiting``: submitted, no node has joined yet;
* ``rendezvous``: a node joined (its torchrun started) or a failure was noticed, until the next
  round closed;
* ``startup`` / ``restart``: the round closed, until its workers were restoring or training
  (``startup`` for the first round, ``restart`` after);
* ``restore``: workers in phase ``restoring``;
* ``training``: steps completed above the highest step reached before (goodput);
* ``recompute``: steps at or below it again, redone after a rollback to an older checkpoint;
* ``checkpoint``: workers in phase ``checkpointing`` (a save that blocked training);
* ``detection``: from the last step before a failure to the event that noticed it;
* ``hang``: from the last step before a hang to ``hang_detected``;
* ``shutdown``: after the last step, until the terminal event.

A record is written when something starts (a phase, the next step), so the time between two
records belongs to what the first one announced (``LedgerState.mode``): the interval after a
record in phase ``checkpointing`` is the save (with the reference trainer, also the step after
it: its next record is that step's). Time in training after the last step is held back
(``LedgerState.t`` stays at the last step) until the next observation says what it was: a
step (training), a restart (detection), a hang. A view of the ledger (``close``) charges what
is held back provisionally to the current mode. The samples are what the agent saw each
``report_interval``, so records in between go unseen; a record carries its process's seconds in
each phase (``phase_s``, ``marind.core.progress``), and between two samples of one process the
ledger charges the differences of those (``_charge_phases``): a save or a restore shorter than a
report is charged to ``checkpoint`` or ``restore`` all the same, and the time a new process spent
before its record was made to ``startup``/``restart``. Without ``phase_s`` (an older worker) each
interval goes to what the earlier sample announced, a phase nobody saw counted with the next.

The state is plain JSON (``to_dict``/``from_dict``): the agent of global rank 0 keeps it in
etcd and goes on folding where another agent left off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

#: Every cause the wall time is charged to; ``training`` is the goodput.
CAUSES = ("training", "checkpoint", "waiting", "rendezvous", "startup", "restart", "restore", "recompute",
          "detection", "hang", "shutdown")

#: Events that say the running round failed (its time since the last step: detection).
FAILURE_EVENTS = ("restart", "node_lost", "host_fenced", "group_failed")
#: Events that end the job.
TERMINAL_EVENTS = ("succeeded", "failed", "cancelled")
_RUNNING = ("startup", "restart", "restore", "training", "recompute", "checkpoint")


@dataclass(frozen=True)
class Sample:
    """Global rank 0's progress record as an agent saw it.

    Attributes:
        at: when the agent read it.
        step: the record's step.
        phase: the record's phase (``marind.core.progress.PHASES``).
        gen: which workers wrote it (rank 0's pid): a new value is a new round.
        round_at: when that round's rendezvous closed (``rdzv/round``'s ``at``), if known.
        phase_s: the record's seconds per phase since its process made it (``ProgressRecord.phase_s``),
            if the worker writes them.
    """

    at: float
    step: int
    phase: str
    gen: str
    round_at: float | None = None
    phase_s: dict[str, float] | None = field(default=None, hash=False, compare=False)


@dataclass
class LedgerState:
    """The fold's state; ``seconds`` holds the time charged so far (up to ``t``)."""

    start: float | None = None
    t: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    mode: str = "waiting"
    step: int = 0
    best: int = 0               # the highest step reached before the current round
    gen: str | None = None
    rounds: int = 0
    seq: int = 0                # the last event folded
    end: float | None = None
    marks: dict[str, float] | None = None    # the current process's ``phase_s`` as of ``t`` (None: unknown)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict | None) -> LedgerState:
        """A stored state; anything unreadable starts afresh."""
        if not isinstance(raw, dict):
            return cls()
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        try:
            state = cls(**known)
            state.seconds = {str(k): float(v) for k, v in dict(state.seconds or {}).items() if k in CAUSES}
            state.marks = None if state.marks is None else {str(k): float(v) for k, v in dict(state.marks).items()}
        except (TypeError, ValueError, AttributeError):
            return cls()
        return state


def _charge(state: LedgerState, cause: str, until: float) -> None:
    if state.t is not None and until > state.t:
        state.seconds[cause] = state.seconds.get(cause, 0.0) + (until - state.t)
        state.t = until


def _begin(state: LedgerState, at: float, mode: str) -> None:
    if state.start is None:
        state.start, state.t, state.mode = at, at, mode


def fold_event(state: LedgerState, event: dict) -> None:
    """Fold one event (``{at, kind, seq?}``) into ``state`` (in place)."""
    t = state.t
    _fold_event(state, event)
    if state.t != t:
        state.marks = None          # the charges moved past the last sample: its phase times start there no more


def _fold_event(state: LedgerState, event: dict) -> None:
    seq = int(event.get("seq") or 0)
    if seq and seq <= state.seq:
        return
    state.seq = max(state.seq, seq)
    if state.end is not None or not isinstance(event.get("at"), (int, float)):
        return
    at, kind = float(event["at"]), str(event.get("kind"))
    _begin(state, at, "waiting")
    assert state.t is not None
    late = at < state.t        # written after later samples were folded: it changes no mode
    if kind in TERMINAL_EVENTS:
        cause = state.mode
        if state.mode in _RUNNING:
            cause = "shutdown" if kind != "failed" else "detection"
        _charge(state, cause, at)
        state.end = max(at, state.t)
    elif kind in ("node_joined", "node_rejoined"):
        if state.mode == "waiting":
            _charge(state, "waiting", at)
            state.mode = "rendezvous"
    elif kind in FAILURE_EVENTS or kind == "hang_detected":
        if kind == "node_lost" and (event.get("detail") or {}).get("action") == "mark":
            return                      # only the rendezvous forgot it: no worker stopped
        if state.mode in _RUNNING and not late:
            _charge(state, "hang" if kind == "hang_detected" else "detection", at)
            state.best, state.mode = max(state.best, state.step), "rendezvous"
        elif not late:
            _charge(state, state.mode, at)


def fold_sample(state: LedgerState, s: Sample) -> None:
    """Fold one progress sample into ``state`` (in place)."""
    if state.end is not None:
        return
    _begin(state, s.at, "startup")
    assert state.t is not None
    if s.at <= state.t:
        return
    base = state.marks
    if s.gen != state.gen:
        base = {}                   # a new process: its phase times start at zero
        if state.gen is not None and state.mode in _RUNNING:
            # a new round before any event said why: the failure is noticed here
            _charge(state, "detection", s.round_at if s.round_at and s.round_at > state.t else s.at)
        if s.round_at is not None and state.t < s.round_at < s.at:
            _charge(state, "waiting" if state.mode == "waiting" else "rendezvous", s.round_at)
        state.best = max(state.best, state.step)
        state.mode = "startup" if state.rounds == 0 else "restart"
        state.gen, state.step, state.rounds = s.gen, s.step, state.rounds + 1
    boot = "startup" if state.rounds <= 1 else "restart"
    if state.mode in ("waiting", "rendezvous"):        # the same workers went on after all (a loss only marked)
        state.mode = _step_cause(state, state.step + 1)
    if s.phase_s is not None and base is not None:
        _charge_phases(state, s, base, boot)
    else:
        _charge_sampled(state, s)
    state.marks = dict(s.phase_s) if s.phase_s is not None else None
    state.mode = _phase_causes(boot).get(s.phase) or _step_cause(state, max(state.step, s.step) + 1)
    state.step = max(state.step, s.step)


def _phase_causes(boot: str) -> dict[str, str]:
    """The cause of time in each phase but training (whose cause depends on the step)."""
    return {"starting": boot, "restoring": "restore", "checkpointing": "checkpoint", "done": "shutdown"}


def _charge_sampled(state: LedgerState, s: Sample) -> None:
    """Charge up to ``s`` by what the sample before it announced (no phase times to go by)."""
    # the time since the last record belongs to what that record announced (``mode``); time in
    # training is charged when a step went by (or the phase moved on), else held back
    advanced = s.step > state.step
    if state.mode in ("training", "recompute"):
        if advanced:
            _charge(state, _step_cause(state, s.step), s.at)
        elif s.phase != "training":
            _charge(state, state.mode, s.at)
    elif s.phase != "training" or advanced or state.mode != "shutdown":
        _charge(state, state.mode, s.at)


def _charge_phases(state: LedgerState, s: Sample, base: dict[str, float], boot: str) -> None:
    """Charge up to ``s`` by its process's own phase times since ``base`` (its ``phase_s`` at ``state.t``;
    ``{}`` for a new process): each phase but training to its cause (``_phase_causes``), training
    to training and recompute in proportion to the steps done at or below the best step before
    (shutdown where no step was done before the worker ended). Time the phase times do not cover
    (before a new process made its record) goes to the current mode; phase times longer than the
    interval (clocks) are scaled down to it."""
    assert s.phase_s is not None and state.t is not None
    span = s.at - state.t
    deltas = {p: max(0.0, v - base.get(p, 0.0)) for p, v in s.phase_s.items()}
    covered = sum(deltas.values())
    scale = min(1.0, span / covered) if covered > 0 else 0.0
    _charge(state, state.mode, s.at - covered * scale)
    done = max(0, s.step - state.step)
    redone = max(0, min(s.step, state.best) - state.step)
    causes = _phase_causes(boot)
    for phase, seconds in sorted(deltas.items()):
        seconds *= scale
        if phase in causes:
            _charge(state, causes[phase], state.t + seconds)
        elif not done and s.phase == "done":
            _charge(state, "shutdown", state.t + seconds)     # after the last step, until the worker ended
        elif done and redone:
            _charge(state, "recompute", state.t + seconds * redone / done)
            _charge(state, "training", state.t + seconds * (done - redone) / done)
        else:
            _charge(state, _step_cause(state, state.step + 1), state.t + seconds)
    state.t = s.at                  # to the float: the parts end where the sample is


def _step_cause(state: LedgerState, step: int) -> str:
    return "recompute" if step <= state.best else "training"


def fold(state: LedgerState, events: Iterable[dict], samples: Iterable[Sample]) -> LedgerState:
    """Fold events and samples into ``state`` in time order (an event first at equal times)."""
    merged: list[tuple[float, int, Any]] = [(float(e.get("at") or 0.0), 0, e) for e in events]
    merged += [(s.at, 1, s) for s in samples]
    for _, kind, item in sorted(merged, key=lambda x: (x[0], x[1], int(x[2].get("seq") or 0) if x[1] == 0 else 0)):
        if kind == 0:
            fold_event(state, item)
        else:
            fold_sample(state, item)
    return state


def close(state: LedgerState, now: float) -> dict[str, Any]:
    """The ledger as shown: ``state`` with the time held back charged to its mode, up to its end or ``now``.

    Returns:
        ``{start, end, wall_s, seconds: {cause: s}, goodput, top: [[cause, s], ...], final}``;
        ``seconds`` sums to ``wall_s`` (to rounding); ``top``: the loss causes, largest first.
        Before anything happened: zeros.
    """
    if state.start is None or state.t is None:
        return {"start": None, "end": None, "wall_s": 0.0, "seconds": {c: 0.0 for c in CAUSES},
                "goodput": None, "top": [], "final": False}
    end = state.end if state.end is not None else max(now, state.t)
    seconds = dict(state.seconds)
    if end > state.t:
        seconds[state.mode] = seconds.get(state.mode, 0.0) + (end - state.t)
    wall = end - state.start
    shown = {c: round(seconds.get(c, 0.0), 3) for c in CAUSES}
    top = sorted(((c, v) for c, v in shown.items() if c != "training" and v > 0), key=lambda x: -x[1])
    return {"start": state.start, "end": end, "wall_s": round(wall, 3), "seconds": shown,
            "goodput": round(seconds.get("training", 0.0) / wall, 4) if wall > 0 else None,
            "top": [[c, v] for c, v in top], "final": state.end is not None}


def compute(events: Iterable[dict], samples: Iterable[Sample], now: float) -> dict[str, Any]:
    """The ledger of a whole history (``fold`` from scratch, then ``close``)."""
    return close(fold(LedgerState(), events, samples), now)


def summary_line(ledger: dict[str, Any], top: int = 3) -> str:
    """``goodput 91.2% of 1h02m; lost: detection 40s, restart 25s, rendezvous 12s``."""
    if ledger.get("goodput") is None:
        return "goodput -"
    causes = ", ".join(f"{c} {_dur(v)}" for c, v in ledger.get("top", [])[:top])
    return f"goodput {100 * ledger['goodput']:.1f}% of {_dur(ledger['wall_s'])}" + (f"; lost: {causes}" if causes else "")


def _dur(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"

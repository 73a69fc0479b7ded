"""A peer's probe state from one probe's outcome to the next (``DataProber._next``; pure)."""

from __future__ import annotations

import pytest

from marind.agent.liveness.data_probe import STEADY_S, DataProber

pytestmark = pytest.mark.unit


def run(outcomes: str, start: float = 100.0):
    """The states after probes one second apart; ``outcomes`` is ``o`` (answered) or ``x`` (failed) each."""
    state, out = None, []
    for i, c in enumerate(outcomes):
        state = DataProber._next(state, "ok" if c == "o" else "timeout", start + i)
        out.append(state)
    return out


def test_one_answer_clears_down_since_but_only_answers_in_a_row_clear_flaky_since():
    states = run("ooxxooo")
    assert [s.down_since for s in states] == [None, None, 102, 102, None, None, None]
    assert STEADY_S == 2.0
    assert [s.flaky_since for s in states] == [None, None, 102, 102, 102, 102, None]
    assert [s.up_since for s in states] == [100, 100, None, None, 104, 104, 104]
    assert states[-1].steady_for(107) == 3 and states[2].steady_for(107) == 0


def test_a_lossy_link_stays_flaky_while_its_probes_answer_by_turns():
    states = run("xoxooxoxxoox")
    assert all(s.flaky_since == 100 for s in states)
    assert [s.down_since is None for s in states] == [c == "o" for c in "xoxooxoxxoox"]

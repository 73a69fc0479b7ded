"""A replica group that goes silent (every process SIGSTOPped, sockets left open, as a host that
loses power) while its peer waits in their cross-group all-reduce: the peer gives the all-reduce
up once the lighthouse has not heard from the group for ``heartbeat_timeout`` and steps on alone,
long before the collective's own ``fault.timeout`` (60 s here, so waiting it out cannot pass).
A group that is merely slow (it waits before its all-reduce, heartbeating) is waited for.
Resumed, the stale group does not commit the step it was frozen in (the others went on without
it), heals from its peer, and both end with the same parameters.

``MARIND_TEST_FT_PAUSE_FILE`` holds group 1 before its all-reduce while the file exists, so the
freeze lands while group 0 is inside that all-reduce (not in a quorum, which the lighthouse
already bounds).
"""

from __future__ import annotations

import json
import signal
import time

import pytest

pytest.importorskip("torchft")

from tests.torchft.groups import ft_spec, logs, progress, signal_group, start_group, wait_for

SLOW_S = 4.0              # a slow step: longer than heartbeat_timeout plus a lighthouse read
ADVANCE_BOUND_S = 45.0    # freeze -> survivor stepped on: under the 60 s collective timeout, so only the abort passes

pytestmark = pytest.mark.timeout(600)



def _events(tmp_path, group: int, event: str) -> list[dict]:
    text = (tmp_path / f"rg{group}.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and f'"{event}"' in line]


def _hold(tmp_path, pause, n: int) -> None:
    """Hold group 1 before its next all-reduce; returns once it waits there (its n-th pause)."""
    pause.touch()
    wait_for(lambda: len(_events(tmp_path, 1, "test_pause")) >= n, 120, "group 1 holding before its all-reduce",
             tmp_path)


@pytest.mark.slow     # CI: a killed group heals (test_ft_training); this one in make chaos
def test_survivor_abandons_the_all_reduce_of_a_silent_group_and_the_group_heals_when_resumed(tmp_path, lighthouse):
    steps, pause = 600, tmp_path / "pause"
    spec = ft_spec(tmp_path, steps=steps, timeout="60s")
    start_group(tmp_path, 0, spec, lighthouse=lighthouse.address)
    stale = start_group(tmp_path, 1, spec, lighthouse=lighthouse.address,
                        env={"MARIND_TEST_FT_PAUSE_FILE": str(pause)})
    wait_for(lambda: progress(tmp_path, 0).get("participants") == 2 and progress(tmp_path, 0).get("step", 0) >= 20,
             180, "both groups stepping together", tmp_path)

    # slow but alive: group 0 waits in the all-reduce and commits the step with both groups
    _hold(tmp_path, pause, 1)
    held = progress(tmp_path, 0)["step"]
    time.sleep(SLOW_S)
    pause.unlink()
    wait_for(lambda: progress(tmp_path, 0).get("step", 0) >= held + 3, 60, "both groups past the slow step", tmp_path)
    assert not _events(tmp_path, 0, "ft_collective_abandoned"), "a slow, heartbeating peer was given up"
    assert progress(tmp_path, 0)["participants"] == 2

    # silent: frozen while group 0 waits in the all-reduce
    _hold(tmp_path, pause, 2)
    assert signal_group(stale, signal.SIGSTOP), "group 1 has no processes to stop"
    at_freeze = progress(tmp_path, 0)["step"]
    wait_for(lambda: progress(tmp_path, 0).get("step", 0) >= at_freeze + 5, ADVANCE_BOUND_S,
             "group 0 stepping on while group 1 is frozen", tmp_path)
    assert progress(tmp_path, 0)["participants"] == 1
    abandoned = _events(tmp_path, 0, "ft_collective_abandoned")
    assert len(abandoned) == 1 and "ftjob_rg1" in abandoned[0]["reason"], abandoned

    pause.unlink()
    signal_group(stale, signal.SIGCONT)
    wait_for(lambda: progress(tmp_path, 0).get("participants") == 2, 120, "group 1 back in the quorum", tmp_path)
    # resumed, its all-reduce may complete at once against group 0's held one: that step is not committed
    late = _events(tmp_path, 1, "ft_collective_abandoned")
    assert len(late) == 1 and "formed without this group" in late[0]["reason"], late
    wait_for(lambda: all(progress(tmp_path, g).get("phase") == "done" for g in (0, 1)), 300, "both groups done",
             tmp_path)
    assert {progress(tmp_path, g)["step"] for g in (0, 1)} == {steps}
    assert progress(tmp_path, 0)["param_digest"] == progress(tmp_path, 1)["param_digest"], logs(tmp_path)
    assert "healing required" in (tmp_path / "rg1.log").read_text(), "group 1 did not take the live state from group 0"

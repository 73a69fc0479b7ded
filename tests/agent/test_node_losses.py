"""What a survivor does about a lost peer (``NodeLosses.act``): every survivor whose workers stalled kills
them, and only the one whose claim wins records the loss (stand-ins for etcd and the outbox)."""

from __future__ import annotations

import pytest

from marind.agent.membership import LEASE_EXPIRED, Loss
from marind.agent.node_losses import NodeLosses
from marind.core.log import get_logger

pytestmark = pytest.mark.unit
NOW = 1000.0


class Members:
    def __init__(self, wins: bool):
        self.wins, self.marked, self.claims = wins, [], []

    def present(self, loss):
        return False

    def rdzv_desc(self, loss):
        return f"{loss.node}_1_0"

    def in_current_round(self, loss, desc):
        return True

    def mark_lost(self, loss, desc):
        self.marked.append(desc)

    def claim(self, loss, detail):
        self.claims.append(detail)
        return self.wins


class Outbox:
    def __init__(self):
        self.events = []

    def event(self, job, kind, detail):
        self.events.append((kind, detail))


def act(wins: bool, progress_at: float) -> tuple[list[str], Outbox, Members]:
    members, outbox, killed = Members(wins), Outbox(), []
    losses = NodeLosses("j", members, outbox, get_logger("test"))
    losses.pending["c"] = Loss("c", "7", LEASE_EXPIRED, {"workers": [{"rank": 4}]})
    losses.act(NOW, 5.0, workers_running=lambda: True, progress_at=progress_at, torchft=False,
               kill_workers=lambda: killed.append("killed") or [11, 12])
    return killed, outbox, members


@pytest.mark.parametrize("wins", [True, False], ids=["records-it", "another-records-it"])
def test_every_survivor_whose_workers_stalled_kills_them(wins):
    """A worker blocked in a send to the lost node ignores torchrun's SIGTERM for its grace (30 s): a
    survivor that did not win the claim must not leave its workers to that."""
    killed, outbox, members = act(wins, progress_at=NOW - 6)
    assert killed == ["killed"] and members.marked == ["c_1_0"]
    assert [kind for kind, _ in outbox.events] == (["node_lost"] if wins else [])
    if wins:
        assert outbox.events[0][1]["killed"] == [11, 12]


def test_workers_that_still_step_are_left_alone():
    killed, outbox, members = act(True, progress_at=NOW - 1)
    assert killed == [] and outbox.events == [] and members.claims == []

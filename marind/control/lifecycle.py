"""Job states and the one transition function (docs/design.md §2).

Every writer of ``{p}/jobs/{job}/state`` goes through ``transition``: it
is pure, returns the new state *and the reason*, and refuses any move
out of a terminal state. Agents apply it with compare-and-swap on the
key's mod_revision, so concurrent agents never lose an update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum


class JobState(str, Enum):
    """A job's state in ``{p}/jobs/{job}/state``."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        """SUCCEEDED, FAILED and CANCELLED never change."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class JobEvent(str, Enum):
    """What moves a job's state (``transition``)."""

    WORKERS_STARTED = "workers_started"   # workers of a (new) generation are up
    RESTART = "restart"                   # torchrun restarted its workers
    SUCCEEDED = "succeeded"               # torchrun exited 0
    FAILED = "failed"                     # torchrun gave up (restarts exhausted)
    CANCEL = "cancel"                     # a user asked


@dataclass(frozen=True)
class StateRecord:
    """The value of ``{p}/jobs/{job}/state``."""

    state: JobState
    reason: str = ""
    restarts: int = 0
    updated_at: float = 0.0
    step: int | None = None     # the last step, set with a terminal state by the agent that moved it there

    def to_dict(self) -> dict:
        """The JSON form stored in etcd; ``step`` only when set."""
        out = {"state": self.state.value, "reason": self.reason,
               "restarts": self.restarts, "updated_at": self.updated_at}
        if self.step is not None:
            out["step"] = self.step
        return out

    @classmethod
    def from_dict(cls, data: dict) -> StateRecord:
        """Read ``to_dict``'s form; missing fields take their defaults."""
        return cls(state=JobState(data.get("state", "PENDING")), reason=str(data.get("reason", "")),
                   restarts=int(data.get("restarts", 0)), updated_at=float(data.get("updated_at", 0.0)),
                   step=None if data.get("step") is None else int(data["step"]))


_MOVES: dict[JobEvent, tuple[set[JobState], JobState]] = {
    JobEvent.WORKERS_STARTED: ({JobState.PENDING, JobState.RESTARTING}, JobState.RUNNING),
    JobEvent.RESTART: ({JobState.PENDING, JobState.RUNNING, JobState.RESTARTING}, JobState.RESTARTING),
    JobEvent.SUCCEEDED: ({JobState.PENDING, JobState.RUNNING, JobState.RESTARTING}, JobState.SUCCEEDED),
    JobEvent.FAILED: ({JobState.PENDING, JobState.RUNNING, JobState.RESTARTING}, JobState.FAILED),
    JobEvent.CANCEL: ({JobState.PENDING, JobState.RUNNING, JobState.RESTARTING}, JobState.CANCELLED),
}


def transition(current: JobState, event: JobEvent) -> tuple[JobState, str]:
    """(new state, reason). A refused or no-op move returns ``current`` and says why."""
    if current.is_terminal():
        return current, f"{current.value} is terminal; {event.value} ignored"
    allowed, target = _MOVES[event]
    if current not in allowed:
        return current, f"{event.value} does not apply to {current.value}"
    return target, f"{current.value} -> {target.value} on {event.value}"


def apply(record: StateRecord, event: JobEvent, *, reason: str = "", restarts: int | None = None,
          step: int | None = None, now: float | None = None) -> StateRecord | None:
    """The record after ``event``, or None when nothing changes (refused or same state).

    ``step`` is kept only on a move into a terminal state: the job's last step as the agent that
    ended it saw it (global rank 0's progress report may land after the state does).
    """
    new, why = transition(record.state, event)
    new_restarts = record.restarts if restarts is None else max(record.restarts, restarts)
    if new == record.state and new_restarts == record.restarts:
        return None
    if new.is_terminal() and record.state.is_terminal():
        return None
    return StateRecord(state=new, reason=reason or why, restarts=new_restarts,
                       updated_at=time.time() if now is None else now,
                       step=step if new.is_terminal() else None)

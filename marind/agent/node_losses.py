"""Another node of a job lost: what this node's run decides about it, and does.

The ``RunMonitor`` of a job with a membership watch keeps one ``NodeLosses``. Each
report polls the job's node records (``poll``: ``Membership.poll``); a node gone is
pending until ``act`` decides on it (``decisions.on_node_loss``): a node whose lease
expired while this node's workers stalled is marked lost for the rendezvous, one agent
records the loss (its claim wins), and every agent whose workers stalled in a round with
it restarts them into a new round at once: SIGKILL, since a worker blocked in a send to
the lost node (no reset ever comes back from a powered-off host, nor over a one-way
drop) would ignore the SIGTERM with which torchrun stops workers for a new round until
its grace ends (30 s). A loss
that the data-network watch declared and acted on already (``note_declared``) is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marind.agent.decisions import LossAction, on_node_loss
from marind.agent.membership import Loss, Membership
from marind.agent.outbox import Outbox


class NodeLosses:
    """One run's lost peers, pending until acted on.

    Args:
        job: the job's id.
        members: the job's membership watch.
        outbox: where ``node_lost`` events go.
        log: the run's logger.
    """

    def __init__(self, job: str, members: Membership, outbox: Outbox, log: Any):
        self.job, self.members, self.outbox, self.log = job, members, outbox, log
        self.pending: dict[str, Loss] = {}              # lost nodes not acted on yet
        self._declared: set[tuple[str, str]] = set()    # (node, incarnation) lost and acted on by another watch
        self._waiting_logged: set[str] = set()

    def poll(self) -> None:
        """Read the job's node records: each node gone since the last poll is pending (raises
        ControlPlaneUnavailable)."""
        for loss in self.members.poll():
            self.log.warning("node_gone", lost=loss.node, cause=loss.cause, in_round=loss.in_round)
            self.pending[loss.node] = loss

    def note_declared(self, loss: Loss) -> None:
        """Another watch (the data network's) declared ``loss`` lost and acted on it: not acted on here."""
        self._declared.add((loss.node, loss.incarnation))

    def act(self, now: float, stall_s: float, *, workers_running: Callable[[], bool], progress_at: float | None,
            torchft: bool, kill_workers: Callable[[], list[int]]) -> None:
        """Decide on each pending loss and act (see the module); raises ControlPlaneUnavailable.

        Args:
            now: the current time.
            stall_s: the stall that counts as stuck (``decisions.stall_window``).
            workers_running: whether this node's workers run.
            progress_at: when this node's round last made progress.
            torchft: a torchft job (no restart: the replica groups' quorum goes on).
            kill_workers: SIGKILL this node's workers (torchrun starts a new round); the pids signalled.
        """
        members = self.members
        for node, loss in list(self.pending.items()):
            if (node, loss.incarnation) in self._declared:
                del self.pending[node]      # declared lost already (silent host, data network gone)
                continue
            if members.present(loss):
                self.log.info("node_back", node=node, reason="its record is back: it was never gone")
                del self.pending[node]
                continue
            desc = members.rdzv_desc(loss)
            action, why = on_node_loss(in_round=members.in_current_round(loss, desc),
                                       workers_running=workers_running(),
                                       progress_at=progress_at, now=now, stall_s=stall_s, torchft=torchft)
            if action == LossAction.WAIT:
                if node not in self._waiting_logged:
                    self._waiting_logged.add(node)
                    self.log.warning("node_lost_waiting", node=node, cause=loss.cause, reason=why)
                continue
            members.mark_lost(loss, desc)
            first = members.claim(loss, {"action": action.value})
            del self.pending[node]
            self._waiting_logged.discard(node)
            # every survivor whose workers stalled kills them, not only the one that records the loss: a
            # worker blocked in a send to the lost node ignores torchrun's SIGTERM for its 30 s grace
            killed = kill_workers() if action == LossAction.RESTART else []
            self.log.warning("node_lost", lost=node, cause=loss.cause, action=action.value, reason=why,
                             recorded=first, rdzv_node=desc, killed=killed)
            if not first:
                continue
            self.outbox.event(self.job, "node_lost", {"node": node, "cause": loss.cause, "action": action.value,
                                                      "reason": why, "killed": killed})

"""Lost nodes leave the rendezvous at once: the agents say which, the handler drops them.

A rendezvous drops a dead node only when its keep-alive expires (a lease
of ``keep_alive_interval * keep_alive_max_attempt`` here), and a round
formed after a loss waits ``last_call_timeout`` for nodes that will not
come. The agents know sooner: a node whose lease expired while the job's
workers stalled is gone (``marind.agent.decisions.on_node_loss``). Here is
how they tell the rendezvous:

* every torchrun started by an agent publishes its rendezvous node
  descriptor under its node's name: ``{p}/jobs/{run_id}/rdzv/members/{node}``
  = ``{desc, pid, at}`` (``publish_member``), and the last closed round's
  number in ``{p}/jobs/{run_id}/rdzv/round`` with each participant's rank key
  under ``rounds/{n}/rank/`` (by the round's closer; ``publish_round``, the
  earlier handler's way, names the participants in the record): an agent
  tells whether a lost node was in the current round;
* an agent that acts on a loss writes ``{p}/jobs/{run_id}/rdzv/lost/{desc}``
  (``marind.agent.membership.Membership.mark_lost``);
* a round's closer reads those markers (``LostNodes``: an etcd watch says
  when to read again, and a read every few seconds covers a broken watch),
  drops the marked torchruns' round keys and leaves them out, and closes a
  round re-forming after a loss as soon as every survivor of the previous
  round has joined (``complete_early``; ``marind.rendezvous.closer``);
* a torchrun marked lost may not join, claim or close a round, nor close the
  rendezvous (it was fenced: a stale process of a node that came back): its
  calls raise ``RendezvousClosedError`` and it exits.

``LossAwareStateHolder`` does the same for the earlier single-key handler
(``marind.rendezvous.state_handler``): it treats a marked node as one whose
keep-alive expired, so torch's own sanitising removes it from the state.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    _BackendRendezvousStateHolder,
)

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.core.rdzv_keys import lost_prefix, members_key, round_key

log = get_logger(__name__)

_EXPIRED = datetime(1970, 1, 1, tzinfo=UTC)
#: seconds between reads of the lost markers when no watch event asked for one
REREAD_S = 5.0


def publish_round(client: EtcdClient, run_id: str, round_: int, participants: frozenset[str]) -> None:
    """Rank 0 of a completed round: publish its number and participants' descriptors.

    Args:
        client: the rendezvous' etcd client.
        run_id: the rendezvous (job) id.
        round_: torch's round number.
        participants: the descriptors of the round's nodes.
    """
    client.put_json(round_key(client, run_id), {"round": round_, "participants": sorted(participants),
                                                "at": time.time()})


def publish_member(client: EtcdClient, run_id: str, node: str, desc: object) -> None:
    """Publish this torchrun's rendezvous descriptor under its marind node's name.

    Args:
        client: the rendezvous' etcd client.
        run_id: the rendezvous (job) id.
        node: the marind node name (``MARIND_NODE``).
        desc: torch's ``_NodeDesc`` of this handler (its ``repr`` is the descriptor).
    """
    client.put_json(members_key(client, run_id, node), {"desc": repr(desc), "pid": os.getpid(), "at": time.time()})


def complete_early(*, last_world: frozenset[str], lost: frozenset[str], participants: frozenset[str],
                   complete: bool, deadline_set: bool) -> bool:
    """Does a round re-forming after a loss complete now rather than after ``last_call_timeout``? (pure)

    Args:
        last_world: the descriptors of the last round this handler was in.
        lost: the descriptors marked lost.
        participants: the descriptors that joined the forming round.
        complete: the round is complete already.
        deadline_set: torch's last-call deadline is set (``min_nodes`` have joined).

    Returns:
        True when a node of the last round was lost and every other one has joined.
    """
    if complete or not deadline_set or not (last_world & lost):
        return False
    return (last_world - lost) <= participants


class LostNodes:
    """The descriptors marked lost for one rendezvous, re-read when etcd says they changed.

    Args:
        client: the rendezvous' etcd client.
        run_id: the rendezvous (job) id.
    """

    def __init__(self, client: EtcdClient, run_id: str) -> None:
        self._client = client
        self.run_id = run_id
        self._prefix = lost_prefix(client, run_id)
        self._descs: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._changed = True
        self._watch: int | None = None
        try:
            self._watch = client.watch_prefix(self._prefix, self._on_change)
        except Exception as exc:  # noqa: BLE001 - without a watch the markers are read every REREAD_S
            log.warning("rdzv_lost_watch_failed", error=f"{type(exc).__name__}: {exc}")

    def _on_change(self, _event: object) -> None:
        self._changed = True

    def descs(self) -> frozenset[str]:
        """The descriptors marked lost (the last known set while etcd is away)."""
        if self._changed or time.monotonic() - self._read_at >= REREAD_S:
            self._changed = False
            try:
                keys = self._client.get_prefix_keys(self._prefix)
            except ControlPlaneUnavailable:
                self._changed = True
                return self._descs
            self._descs = frozenset(k[len(self._prefix):] for k in keys if k.startswith(self._prefix))
            self._read_at = time.monotonic()
        return self._descs

    def round_completed(self, round_: int, participants: frozenset[str]) -> None:
        """Rank 0: publish the completed round (housekeeping: a failure is only logged)."""
        try:
            publish_round(self._client, self.run_id, round_, participants)
        except ControlPlaneUnavailable as exc:
            log.warning("rdzv_round_publish_failed", run_id=self.run_id, error=str(exc))

    def close(self) -> None:
        """Cancel the watch."""
        if self._watch is not None:
            self._client.cancel_watch(self._watch)
            self._watch = None


class LossAwareStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, with the agents' lost markers applied to every state it reads.

    Args:
        backend: the rendezvous backend.
        settings: the rendezvous settings.
        lost: the lost markers.
        this_node: this handler's descriptor (``repr``): writes stop once it is marked lost.
    """

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings, lost: LostNodes,
                 this_node: str) -> None:
        super().__init__(backend, settings)
        self._lost = lost
        self._this_node = this_node
        #: the descriptors of the last round this handler completed (``world_formed``)
        self.last_world: frozenset[str] = frozenset()

    def world_formed(self, rank: int) -> None:
        """A round completed with this node at ``rank``: remember it; rank 0 publishes it."""
        self.last_world = frozenset(repr(n) for n in self._state.participants)
        if rank == 0:
            self._lost.round_completed(self._state.round, self.last_world)

    def sync(self) -> bool | None:
        """torch's sync; a write from a torchrun marked lost raises RendezvousClosedError."""
        if self._dirty and self._this_node in self._lost.descs():
            raise RendezvousClosedError(
                f"the agents declared this node ({self._this_node}) lost; it must not rejoin with this "
                "torchrun (its agent starts a new one)")
        return super().sync()

    def _sanitize(self) -> None:
        state = self._state
        lost = self._lost.descs()
        if lost:
            nodes = {*state.participants, *state.wait_list, *state.redundancy_list, *state.last_heartbeats}
            for node in nodes:
                if repr(node) in lost:
                    log.info("rdzv_drop_lost_node", node=repr(node), round=state.round)
                    state.last_heartbeats[node] = _EXPIRED     # torch's sanitising removes it
        super()._sanitize()
        if complete_early(last_world=self.last_world, lost=lost,
                          participants=frozenset(repr(n) for n in state.participants),
                          complete=state.complete, deadline_set=state.deadline is not None):
            state.deadline = datetime.now(UTC) - timedelta(seconds=1)

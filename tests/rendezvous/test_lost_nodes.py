"""Lost markers on a real etcd: the state holder drops a marked node at once, a round re-forming
after a loss completes once the survivors are in, and a torchrun marked lost may not write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from marind.core.rdzv_keys import lost_prefix, round_key
from marind.rendezvous import Etcd3RendezvousBackend
from marind.rendezvous.lost import LossAwareStateHolder, LostNodes
from tests.agent.helpers import wait_for

A, B, C = (_NodeDesc("host", pid, 0) for pid in (10, 20, 30))


def _settings(run_id: str) -> RendezvousSettings:
    return RendezvousSettings(run_id, 1, 3, RendezvousTimeout(last_call=timedelta(seconds=600)),
                              keep_alive_interval=timedelta(seconds=600), keep_alive_max_attempt=3)


@pytest.fixture
def holders(etcd_client):
    made: list[LostNodes] = []

    def make(run_id: str, me: _NodeDesc) -> LossAwareStateHolder:
        lost = LostNodes(etcd_client, run_id)
        made.append(lost)
        return LossAwareStateHolder(Etcd3RendezvousBackend(etcd_client, run_id), _settings(run_id), lost, repr(me))
    yield make
    for lost in made:
        lost.close()


def _write(holder: LossAwareStateHolder, state: _RendezvousState) -> None:
    holder._state = state
    holder.mark_dirty()
    assert holder.sync() is True


def _mark(etcd_client, run_id: str, node: _NodeDesc, *seen_by: LossAwareStateHolder) -> None:
    etcd_client.put_json(lost_prefix(etcd_client, run_id) + repr(node), {"node": "x", "cause": "lease_expired"})
    for holder in seen_by:       # the watch event arrives asynchronously
        wait_for(lambda h=holder: repr(node) in h._lost.descs(), 10, "the lost marker seen")


def test_a_marked_node_leaves_the_state_at_once(etcd_client, holders):
    now = datetime.now(UTC)
    state = _RendezvousState()
    state.round, state.complete = 4, True
    state.participants = {A: 0, B: 1, C: 2}
    state.last_heartbeats = {A: now, B: now, C: now}       # fresh: torch alone keeps A for minutes
    writer = holders("r1", B)
    _write(writer, state)
    reader = holders("r1", C)
    reader.sync()
    assert set(reader.state.participants) == {A, B, C}
    _mark(etcd_client, "r1", A, reader)
    reader._last_sync_time = -1                               # past torch's 1 s cache
    reader.sync()
    assert set(reader.state.participants) == {B, C} and A not in reader.state.last_heartbeats
    assert reader.state.complete                              # the survivors' round goes on until they leave it


def test_a_round_after_a_loss_completes_once_the_survivors_joined(etcd_client, holders):
    holder = holders("r2", B)
    holder.last_world = frozenset({repr(A), repr(B), repr(C)})
    state = _RendezvousState()
    state.round = 5
    state.participants = {B: 0, C: 0}
    state.last_heartbeats = {B: datetime.now(UTC), C: datetime.now(UTC)}
    state.deadline = datetime.now(UTC) + timedelta(seconds=600)   # torch's last call
    _write(holder, state)
    assert holder.state.deadline > datetime.now(UTC)          # nobody was lost: torch waits
    _mark(etcd_client, "r2", A, holder)
    holder._last_sync_time = -1
    holder.sync()
    assert holder.state.deadline < datetime.now(UTC)          # complete now


def test_a_torchrun_marked_lost_may_not_write_and_rank0_publishes_its_round(etcd_client, holders):
    stale = holders("r3", A)
    state = _RendezvousState()
    state.round, state.complete = 2, True
    state.participants = {A: 0, B: 1}
    state.last_heartbeats = {A: datetime.now(UTC), B: datetime.now(UTC)}
    _write(stale, state)
    stale.world_formed(0)
    assert etcd_client.get_json(round_key(etcd_client, "r3"))["participants"] == sorted([repr(A), repr(B)])
    _mark(etcd_client, "r3", A, stale)
    stale.mark_dirty()
    with pytest.raises(RendezvousClosedError, match="declared this node"):
        stale.sync()

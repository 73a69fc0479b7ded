"""A restore that fell back from a lost memory checkpoint is one ``checkpoint_memory_fallback`` event
per restart (global rank 0's record carries the pick; the agent tells it), on a real etcd."""

from __future__ import annotations

from marind.agent.metrics import Metrics
from marind.agent.outbox import Outbox
from marind.agent.progress import ProgressRecord
from marind.agent.run_progress import RunProgress
from marind.control.events import CHECKPOINT_MEMORY_FALLBACK, list_events
from marind.trainer.memory_ckpt import pick_restore


def _rec(step, pid, restore):
    return ProgressRecord(rank=0, local_rank=0, world_size=2, pid=pid, step=step, loss=1.0, tokens_per_s=1.0,
                          last_checkpoint_step=None, phase="training", updated_at=float(step), restore=restore)


def test_a_memory_fallback_is_one_event_per_restart(etcd_client):
    job = "memfb-1"
    progress = RunProgress(job, Outbox(etcd_client, "na", online=lambda: True, offline=lambda: None), Metrics())
    lost = pick_restore([(9, False, "2 of 18 objects on no live node")], durable=5).record()
    whole = pick_restore([(12, True, "ok")], durable=5).record()
    for step in (5, 6, 7):                                   # one worker, several ticks
        progress.observe([_rec(step, 100, lost)], float(step), restarts=1)
    for step in (12, 13):                                    # the next restart restored from memory
        progress.observe([_rec(step, 101, whole)], float(step), restarts=2)
    events = [e for e in list_events(etcd_client, job) if e["kind"] == CHECKPOINT_MEMORY_FALLBACK]
    assert len(events) == 1, events
    detail = events[0]["detail"]
    assert detail["step"] == 5 and detail["lost_step"] == 9 and "on no live node" in detail["reason"], detail


def test_records_round_trip_the_restore_field():
    rec = _rec(3, 1, {"source": "memory", "step": 3, "reason": "r", "fallback": False, "lost_step": None})
    assert ProgressRecord.from_dict(rec.to_dict()) == rec
    assert "restore" not in _rec(3, 1, None).to_dict()

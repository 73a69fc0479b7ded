"""Memory checkpoints on the multi-host bed (issue 33): a host powered off right after a memory
checkpoint that the durable store never saw; the survivors restore that step from the lost
host's replica, in their own memory, into the smaller world, and the job completes.

Bit-for-bit equality of a restored memory step is asserted where the saved state is at hand
(tests/ckpt_store/memory/test_memory_restore.py, tests/trainer/test_memory_ckpt_train.py); here
the real path: agents, torchrun, a silent host, the restart, the restore from the replica.
``slow`` (``make chaos``).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from tests.agent.helpers import wait_for
from tests.chaos.test_host_scenarios import (  # noqa: F401 - fixtures
    BedCluster,
    _lost_events,
    _submit,
    _training_on_all,
    bed_cluster,
    dataset,
    hostbed,
)

pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.timeout(1500)]


def _log_events(cluster: BedCluster, job: str, event: str) -> list[dict]:
    out = []
    for path in cluster.tmp.glob(f"state-*/jobs/{job}/logs/torchrun.log"):
        for line in path.read_text(errors="replace").splitlines():
            if f'"event": "{event}"' in line and "{" in line:
                out.append(json.loads(line[line.index("{"):]))
    return out


def test_power_off_after_a_memory_checkpoint_restores_it_from_the_replica(bed_cluster, monkeypatch):  # noqa: F811
    cluster = bed_cluster
    mem = Path(f"/dev/shm/marind-bed-{uuid.uuid4().hex[:8]}")
    steps = 30
    orig = _submit.__globals__["_spec"]

    def spec_with_memory(*args, **kwargs):
        path = orig(*args, **kwargs)
        text = Path(path).read_text().replace("[checkpoint]\n", f'[checkpoint]\nmemory_every = 1\nmemory_dir = "{mem}"\n')
        Path(path).write_text(text)
        return path

    monkeypatch.setitem(_submit.__globals__, "_spec", spec_with_memory)
    try:
        job, _url = _submit(cluster, "mem-power-off", "1:2", steps, every=1000)   # durable: the final step only
        _training_on_all(cluster, job, 8)
        victim = cluster.host_of_rank(job, 0)           # rank 0's host: its parts live on only in the replica
        frozen = cluster.bed.power_off(victim)
        assert frozen, f"nothing ran in {victim}"
        lost_at = cluster.step(job)
        wait_for(lambda: cluster.world_size(job) == 2 and cluster.step(job) > lost_at, 300,
                 "the survivor training alone", interval=0.2, diag=cluster.diag)
        state = cluster.wait_done(job, timeout=900)
        assert state["state"] == "SUCCEEDED", state
        assert len(_lost_events(cluster, job, victim)) == 1, cluster.events(job)
        from_memory = _log_events(cluster, job, "restored_from_memory")
        assert from_memory, cluster.diag()
        step = from_memory[-1]["step"]
        assert lost_at - 2 <= step <= lost_at, (step, lost_at)   # at most the step in flight is lost
        restored = _log_events(cluster, job, "restored")
        assert restored and restored[-1]["step"] == step, restored
        assert not _log_events(cluster, job, "checkpoint_memory_fallback")
        assert sorted(cluster.losses(job)) == list(range(1, steps + 1))
    finally:
        shutil.rmtree(mem, ignore_errors=True)

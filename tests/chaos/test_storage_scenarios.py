"""Storage that fills or pushes back, under a live job (issue 32): agents, the real trainer, etcd, S3.

* a checkpoint volume (a 24 MiB tmpfs) that fills mid-run and stays full: training never stops
  stepping, the job reaches its last step and SUCCEEDED, every committed step verifies, and
  ``status`` (the job's reason) and ``events`` (``checkpoint_failed``) name the full disk;
* an S3 storm (503 SlowDown to every request for 30 s, through ``marind.testing.s3_faults``)
  during training: 0 committed checkpoints lost, the job SUCCEEDED.

Each runs under the history checker (``marind.testing.history``) and, with
``MARIND_FAULTS_TABLE`` set (``make chaos``), adds its row to the faults table. Both are
``@pytest.mark.slow``; CI runs the reduced forms (tests/trainer/test_full_disk.py,
tests/ckpt_store/save/test_s3_storm.py).
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace

import pytest

from ckpt_store import CheckpointStore
from ckpt_store.errors import DISK_FULL, failure_kind
from marind.cli import main as marind_main
from marind.control.events import CHECKPOINT_FAILED
from marind.control.jobs_client import JobsClient
from marind.testing.history import append_row, fault_row, step_timeline
from marind.testing.history import check as check_history
from marind.testing.history import collect as collect_history
from marind.testing.s3_faults import S3FaultProxy
from marind.testing.small_fs import can_mount, fill, small_tmpfs
from tests.agent.helpers import job_state, wait_for
from tests.chaos.test_scenarios import Cluster, _spec, dataset  # noqa: F401 - dataset: a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture
def one_node(tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch):  # noqa: F811
    return Cluster(tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch, ("a",))


def _submit(cluster: Cluster, name: str, url: str, endpoint_of, **spec_kw) -> str:
    cluster.capsys.readouterr()
    rc = marind_main(["submit", _spec(cluster.tmp, name, cluster.data, url, endpoint_of, 1, **spec_kw)])
    out = cluster.capsys.readouterr().out
    assert rc == 0, out
    return out.strip().splitlines()[-1]


def _history(cluster: Cluster, job: str, store: CheckpointStore, scenario: str, expect_step: int | None) -> None:
    history = collect_history(cluster.client, job, store)
    history.save(cluster.tmp / f"history-{job}.json")
    problems = check_history(history, store, expect_state="SUCCEEDED", expect_step=expect_step)
    table = os.environ.get("MARIND_FAULTS_TABLE")
    if table:
        timeline = step_timeline(list(cluster.tmp.glob(f"state-*/jobs/{job}/logs/torchrun.log")))
        append_row(table, fault_row(scenario, history, timeline, problems))
    assert not problems, "history violations:\n" + "\n".join(problems)


@pytest.mark.skipif(can_mount() is not None, reason=can_mount() or "")
def test_checkpoint_volume_full_mid_run_stays_full(one_node, tmp_path):
    cluster, steps = one_node, 40
    with small_tmpfs(tmp_path / "vol", 24) as vol:
        url = f"file://{vol}/ckpt"
        job = _submit(cluster, "fulldisk", url, cluster.s3, steps=steps, every=5)
        store = CheckpointStore(url)
        wait_for(lambda: store.latest(), 300, "a first commit", diag=cluster.diag)
        fill(vol)                                      # full, and it stays full
        failed = wait_for(lambda: [e for e in cluster.events(job) if e["kind"] == CHECKPOINT_FAILED], 300,
                          "a checkpoint_failed event", diag=cluster.diag)
        assert failure_kind(failed[0]["detail"]["reason"]) == DISK_FULL, failed
        reason = wait_for(lambda: (lambda r: r if "No space left" in r else None)(
            JobsClient(cluster.client).job(job)["reason"]), 120, "status naming the full disk")
        assert "keep_last" in reason, reason               # the fix, too
        state = cluster.wait_done(job, timeout=600)
        assert state["state"] == "SUCCEEDED", state
        assert cluster.step(job) == steps                  # training never stopped for it
        committed = store.steps()
        assert committed and committed[-1] < steps, committed   # the final save did not fit either
        for step in committed:
            report = store.verify(step)
            assert report.ok, (step, report.problems)
        assert "No space left" in JobsClient(cluster.client).job(job)["reason"]
        _history(cluster, job, store, "checkpoint_volume_full", expect_step=committed[-1])
        store.close()


def test_s3_storm_during_training_loses_nothing(one_node):
    cluster, steps = one_node, 200
    with S3FaultProxy(cluster.s3.endpoint, seed=3) as proxy:
        url = cluster.s3.url(f"storm-{uuid.uuid4().hex[:8]}", "storm")
        job = _submit(cluster, "s3storm", url, SimpleNamespace(endpoint=proxy.endpoint), steps=steps, every=5)
        store = CheckpointStore(url, storage_options=cluster.s3.storage_options)
        wait_for(lambda: store.latest(), 300, "a first commit", diag=cluster.diag)
        seen_before = store.steps()
        step_at = cluster.step(job)
        proxy.storm(30.0)                                  # 503 SlowDown to every request
        time.sleep(30.0)
        assert proxy.counts["status"] > 0
        assert cluster.step(job) > step_at                 # steps went on through the storm
        state = cluster.wait_done(job, timeout=600)
        assert state["state"] == "SUCCEEDED", state
        committed = store.steps()
        assert set(seen_before) <= set(committed) and committed[-1] == steps, (seen_before, committed)
        _history(cluster, job, store, "s3_storm_30s", expect_step=steps)
        assert job_state(cluster.client, job)["state"] == "SUCCEEDED"
        store.close()

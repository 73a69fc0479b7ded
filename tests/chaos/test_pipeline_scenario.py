"""A pipelined job under the agent (``parallel.pp = 2``, one node of 2 ranks): a worker killed
mid-run, the job SUCCEEDED, and its final checkpoint bit-identical to a fault-free run's.

The cluster and its helpers are the chaos scenarios' (``tests.chaos.test_scenarios``); only the
spec differs: an untied tiny model split into two stages of one layer each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from marind.trainer.data import corpus
from tests.chaos import test_scenarios as sc
from tests.chaos.conftest import run_injector

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


PIPELINE = 'preset = "tiny"\ntie_embeddings = false\n[parallel]\npp = 2\ndp_shard = 1\npp_microbatches = 4\n'


_dense_spec = sc._spec


def _pp_spec(*args, **kw) -> str:
    """The scenarios' spec with the model split into two pipeline stages."""
    path = _dense_spec(*args, **kw)
    text = Path(path).read_text()
    assert '[model]\npreset = "tiny"\n' in text
    Path(path).write_text(text.replace('[model]\npreset = "tiny"\n', "[model]\n" + PIPELINE))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("chaos-pp-data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


@pytest.fixture
def cluster(tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch):
    """One agent of 2 slots (the scenarios' ``Cluster``) whose submits split the model in two stages."""
    monkeypatch.setattr(sc, "_spec", _pp_spec)
    return sc.Cluster(tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch, ("a",))


def test_pp2_worker_killed_recovers_bit_identical(cluster):
    job, url = cluster.submit("baseline-pp")   # not the scenarios' cached (dense) baseline; "baseline": no table row
    assert cluster.wait_done(job)["state"] == "SUCCEEDED"
    baseline = sc.final_tensor_objects(sc._check_checkpoints(cluster, url), url, cluster.s3)
    assert any("layers.1." in k for k in baseline) and any(k.startswith("model/output.weight") for k in baseline)

    job, url = cluster.submit("pp-killed")
    res = run_injector("kill_random_rank", "--job", job, "--seed", "1", "--after-step",
                       str(sc.EVERY + 2), "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix, timeout=240)
    assert res.returncode == 0, res.stderr
    assert len(res.lines) == 1 and res.lines[0]["action"] == "kill"
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    assert state.get("restarts", 0) >= 1
    store = sc._check_checkpoints(cluster, url)
    assert sc.final_tensor_objects(store, url, cluster.s3) == baseline, \
        "after one kill the pipelined job's final state must be bit-identical to the fault-free run"

"""Chaos scenarios against a live job: 2 agents (nodes) x 2 ranks of the real trainer on real S3.

Each scenario asserts that the job reaches SUCCEEDED with its configured
step count, that every committed checkpoint still verifies, that the
final parameters and optimizer state are bit-identical to a fault-free
run of the same spec (the layout does not change), and that the events
in etcd record the fault's recovery. CI runs the reduced set; the rest
is ``@pytest.mark.slow`` (``make chaos``).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from ckpt_store import CheckpointStore
from marind.cli import main as marind_main
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for
from tests.chaos.conftest import run_injector
from tests.support.s3_server import ACCESS_KEY, SECRET_KEY
from trainer import corpus

STEPS = 24
EVERY = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("chaos-data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


def _spec(tmp, name: str, data: str, url: str, s3, nodes: int, hang_timeout: str = "60s") -> str:
    text = f"""
[job]
name = "{name}"
nodes = "{nodes}"
nproc_per_node = 2
max_restarts = 10
hang_timeout = "{hang_timeout}"
entrypoint = "trainer"
[job.env]
AWS_ENDPOINT_URL = "{s3.endpoint}"
AWS_ACCESS_KEY_ID = "{ACCESS_KEY}"
AWS_SECRET_ACCESS_KEY = "{SECRET_KEY}"
AWS_DEFAULT_REGION = "us-east-1"
OMP_NUM_THREADS = "1"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = 8
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 3
[train]
steps = {STEPS}
seed = 7
log_every = 1
[checkpoint]
url = "{url}"
every_steps = {EVERY}
async = true
keep_last = 0
"""
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return str(path)


class Cluster:
    def __init__(self, tmp, etcd, client, prefix, s3, data, capsys, monkeypatch, nodes=("a", "b")):
        self.tmp, self.etcd, self.client, self.prefix = tmp, etcd, client, prefix
        self.s3, self.data, self.capsys, self.nodes = s3, data, capsys, nodes
        monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
        monkeypatch.setenv("MARIND_PREFIX", prefix)
        for node in nodes:
            start_agent(tmp, node, etcd.endpoint, prefix, slots=2)
        for node in nodes:
            wait_for(lambda: node_registered(client, node), 60, f"node {node} registered",
                     diag=self.diag)

    def diag(self) -> str:
        return "\n".join(f"--- agent {n} ---\n{agent_log(self.tmp, n)}" for n in self.nodes)

    def submit(self, name: str, **spec_kw) -> tuple[str, str]:
        url = self.s3.url(f"chaos-{uuid.uuid4().hex[:8]}", name)
        self.capsys.readouterr()
        rc = marind_main(["submit", _spec(self.tmp, name, self.data, url, self.s3, len(self.nodes),
                                          **spec_kw)])
        out = self.capsys.readouterr().out
        assert rc == 0, out
        return out.strip().splitlines()[-1], url

    def wait_done(self, job: str, timeout: float = 300) -> dict:
        wait_for(lambda: job_state(self.client, job).get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"),
                 timeout, f"{job} finished", interval=0.5,
                 diag=lambda: f"{job_state(self.client, job)}\n{self.diag()}")
        return job_state(self.client, job)

    def step(self, job: str) -> int:
        recs = self.client.get_prefix_json(self.client.key("jobs", job, "nodes") + "/").values()
        progress = self.client.get_json(self.client.key("jobs", job, "progress")) or {}
        return max([progress.get("step") or 0] + [r.get("step") or 0 for r in recs])

    def events(self, job: str) -> list[dict]:
        rows = self.client.get_prefix_json(self.client.key("jobs", job, "events") + "/")
        return [rows[k] for k in sorted(rows)]

    def store(self, url: str) -> CheckpointStore:
        return CheckpointStore(url, storage_options=self.s3.storage_options)


def final_tensor_objects(store: CheckpointStore, url: str, s3) -> dict[str, bytes]:
    """The raw bytes of every model/optim chunk object of the final checkpoint."""
    step = store.latest()
    manifest = store.manifest(step)
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
    base = f"{url.removeprefix('s3://')}/step-{step:010d}"
    keys = sorted(k for k in manifest["objects"]
                  if k.startswith(("model/", "optim/")) and not k.endswith("zarr.json"))
    return {k: fs.cat(f"{base}/{k}") for k in keys}


@pytest.fixture
def cluster(request, tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch):
    nodes = getattr(request, "param", ("a", "b"))
    return Cluster(tmp_path, etcd, etcd_client, etcd_prefix, s3, dataset, capsys, monkeypatch, nodes)


def _check_checkpoints(cluster: Cluster, url: str) -> CheckpointStore:
    store = cluster.store(url)
    steps = store.steps()
    assert steps and steps[-1] == STEPS, steps
    for step in steps:
        report = store.verify(step)
        assert report.ok, (step, report.problems)
    return store


ONE_NODE = pytest.param(("a",), id="1x2")
TWO_NODES = pytest.param(("a", "b"), id="2x2", marks=[
    pytest.mark.slow,
    pytest.mark.xfail(reason="known: after a worker kill the two nodes' torchruns restart out of step and "
                             "gloo connectFullMesh is refused round after round (agent/rendezvous)",
                      strict=False)])


_BASELINES: dict[int, dict[str, bytes]] = {}


def fault_free_final_state(cluster: Cluster) -> dict[str, bytes]:
    """The final checkpoint's tensor bytes of a fault-free run of the spec (once per module)."""
    n = len(cluster.nodes)
    if n not in _BASELINES:
        job, url = cluster.submit("baseline")
        assert cluster.wait_done(job)["state"] == "SUCCEEDED"
        _BASELINES[n] = final_tensor_objects(_check_checkpoints(cluster, url), url, cluster.s3)
    return _BASELINES[n]


@pytest.mark.parametrize("cluster", [ONE_NODE, TWO_NODES], indirect=True)
def test_kill_random_rank_once_recovers_bit_identical(cluster):
    baseline = fault_free_final_state(cluster)

    job, url = cluster.submit("killed")
    res = run_injector("kill_random_rank", "--job", job, "--seed", "1", "--after-step",
                       str(EVERY + 2), "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix,
                       timeout=240)
    assert res.returncode == 0, res.stderr
    assert len(res.lines) == 1 and res.lines[0]["action"] == "kill"
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    assert state.get("restarts", 0) >= 1
    kinds = [e["kind"] for e in cluster.events(job)]
    assert "restart" in kinds, kinds
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline, \
        "after one kill the final state must be bit-identical to the fault-free run"


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [ONE_NODE], indirect=True)
def test_corrupt_newest_checkpoint_at_restart_falls_back(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("corrupt")
    wait_for(lambda: cluster.step(job) >= 2 * EVERY + 1 and len(cluster.store(url).steps()) >= 2,
             240, "two committed checkpoints", interval=0.2, diag=cluster.diag)
    opts = json.dumps({"key": ACCESS_KEY, "secret": SECRET_KEY})
    bad = run_injector("corrupt_checkpoint", "--job", job, "--within", "model/", "--seed", "2",
                       "--storage-options", opts, "--s3-endpoint", cluster.s3.endpoint,
                       etcd=cluster.etcd, prefix=cluster.prefix)
    assert bad.returncode == 0, bad.stderr
    corrupted = bad.lines[0]["step"]
    kill = run_injector("kill_random_rank", "--job", job, "--seed", "3", "--wait", "60",
                        etcd=cluster.etcd, prefix=cluster.prefix)
    assert kill.returncode == 0, kill.stderr
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    logs = "".join(p.read_text(errors="replace") for p in cluster.tmp.glob("state-*/jobs/*/logs/*.log"))
    restored = [json.loads(x[x.index("{"):]) for x in logs.splitlines()
                if '"event": "restored"' in x and x.lstrip().startswith(("{", "["))]
    assert "ckpt_skip_corrupt" in logs, "the corrupt newest checkpoint must be skipped at restart"
    assert restored and all(r.get("step") != corrupted for r in restored), restored
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline


def _finish_like_baseline(cluster: Cluster, job: str, url: str, baseline: dict) -> dict:
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline
    return state


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [ONE_NODE], indirect=True)
def test_hung_rank_is_restarted_by_the_hang_timeout(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("hung", hang_timeout="8s")
    res = run_injector("hang_rank", "--job", job, "--seed", "4", "--after-step", str(EVERY + 2),
                       "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix, timeout=240)
    assert res.returncode == 0 and [ln["action"] for ln in res.lines] == ["hang"], res.stderr
    _finish_like_baseline(cluster, job, url, baseline)
    kinds = [e["kind"] for e in cluster.events(job)]
    assert "hang_detected" in kinds and "restart" in kinds, kinds


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [ONE_NODE], indirect=True)
def test_etcd_restarted_under_a_running_job(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("etcd-out")
    wait_for(lambda: cluster.step(job) >= EVERY + 2, 240, "training under way", diag=cluster.diag)
    res = run_injector("etcd_outage", "--job", job, "--seconds", "5", "--state",
                       str(cluster.etcd.state_path), etcd=cluster.etcd, prefix=cluster.prefix,
                       timeout=120)
    assert res.returncode == 0 and len(res.lines) == 2, res.stderr
    _finish_like_baseline(cluster, job, url, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [ONE_NODE], indirect=True)
def test_storage_outage_during_a_save(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("s3-out")
    opts = json.dumps({"key": ACCESS_KEY, "secret": SECRET_KEY})
    res = run_injector("storage_outage", "--job", job, "--during-save", "--seconds", "5",
                       "--state", str(cluster.s3.state_path), "--storage-options", opts,
                       "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix, timeout=300)
    assert res.returncode == 0 and res.lines[0].get("during_save_step"), res.stderr
    _finish_like_baseline(cluster, job, url, baseline)

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
import os
import uuid

import pytest

from ckpt_store import CheckpointStore
from marind.cli import main as marind_main
from marind.control.events import list_events
from marind.testing.history import (
    append_row,
    fault_row,
    merge_timelines,
    step_timeline,
    steps_run_again,
    timeline_span,
)
from marind.testing.history import check as check_history
from marind.testing.history import collect as collect_history
from marind.testing.s3_server import ACCESS_KEY, SECRET_KEY
from marind.trainer.data import corpus
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for
from tests.chaos.conftest import run_injector

STEPS = 24
EVERY = 6
# a scenario is a fault-free baseline (once per module) plus the faulty run, each a few minutes on 2 cores
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("chaos-data") / "corpus"
    corpus.write_example_dataset(prefix, 60)
    return str(prefix)


def _spec(tmp, name: str, data: str, url: str, s3, nodes: int | str, hang_timeout: str = "60s",
          steps: int = STEPS, every: int = EVERY, global_batch: int = 8) -> str:
    """The run.toml of the scenarios' trainer job; ``s3`` None: a checkpoint URL that needs no S3 credentials."""
    s3_env = "" if s3 is None else (f'AWS_ENDPOINT_URL = "{s3.endpoint}"\nAWS_ACCESS_KEY_ID = "{ACCESS_KEY}"\n'
                                    f'AWS_SECRET_ACCESS_KEY = "{SECRET_KEY}"\nAWS_DEFAULT_REGION = "us-east-1"\n')
    text = f"""
[job]
name = "{name}"
nodes = "{nodes}"
nproc_per_node = 2
max_restarts = 10
hang_timeout = "{hang_timeout}"
entrypoint = "marind.trainer"
[job.env]
{s3_env}OMP_NUM_THREADS = "1"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = {global_batch}
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 3
[train]
steps = {steps}
seed = 7
log_every = 1
[checkpoint]
url = "{url}"
every_steps = {every}
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
            wait_for(lambda node=node: node_registered(client, node), 60, f"node {node} registered",
                     diag=self.diag)

    def diag(self) -> str:
        return "\n".join(f"--- agent {n} ---\n{agent_log(self.tmp, n)}" for n in self.nodes)

    def submit(self, name: str, nodes: int | str | None = None, **spec_kw) -> tuple[str, str]:
        url = self.s3.url(f"chaos-{uuid.uuid4().hex[:8]}", name)
        self.capsys.readouterr()
        rc = marind_main(["submit", _spec(self.tmp, name, self.data, url, self.s3,
                                          nodes or len(self.nodes), **spec_kw)])
        out = self.capsys.readouterr().out
        assert rc == 0, out
        job = out.strip().splitlines()[-1]
        self.__dict__.setdefault("jobs", {})[url] = job       # the history checker finds the job by its store
        return job, url

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
        return list_events(self.client, job)

    def store(self, url: str) -> CheckpointStore:
        return CheckpointStore(url, storage_options=self.s3.storage_options)

    def restarts_per_node(self, job: str) -> dict[str, int]:
        """How many new worker generations after the first each node's agent recorded."""
        out = {n: 0 for n in self.nodes}
        for e in self.events(job):
            if e["kind"] == "restart" and "round" in (e.get("detail") or {}):
                out[e["node"]] = out.get(e["node"], 0) + 1
        return out

    def losses(self, job: str) -> dict[int, float]:
        """Global rank 0's loss at each step, from the trainer logs of every node (last run of a step)."""
        out: dict[int, float] = {}
        logs = sorted(self.tmp.glob(f"state-*/jobs/{job}/logs/torchrun.log"),
                      key=lambda p: p.stat().st_mtime)
        rows = []
        for path in logs:
            for line in path.read_text(errors="replace").splitlines():
                if '"event": "step"' in line and "{" in line:
                    try:
                        rec = json.loads(line[line.index("{"):])
                    except ValueError:
                        continue
                    rows.append((rec.get("timestamp", ""), int(rec["step"]), float(rec["loss"])))
        for _, step, loss in sorted(rows):
            out[step] = loss
        return out

    def world_size(self, job: str) -> int:
        return int((self.client.get_json(self.client.key("jobs", job, "progress")) or {}).get("world_size") or 0)

    def restart_agent(self, node: str) -> None:
        start_agent(self.tmp, node, self.etcd.endpoint, self.prefix, slots=2)
        wait_for(lambda: node_registered(self.client, node), 60, f"node {node} registered again",
                 diag=self.diag)


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


def _check_checkpoints(cluster: Cluster, url: str, steps_total: int = STEPS,
                      again_s: float | None = None) -> CheckpointStore:
    """Every committed checkpoint verifies, the last is ``steps_total``, and the job's history holds
    every invariant of ``marind.testing.history`` (kept beside the test's files as history-JOB.json).
    ``again_s``: the scenario's measured seconds from its fault to training again, for the faults table."""
    store = cluster.store(url)
    steps = store.steps()
    assert steps and steps[-1] == steps_total, steps
    for step in steps:
        report = store.verify(step)
        assert report.ok, (step, report.problems)
    job = cluster.__dict__.get("jobs", {}).get(url)
    if job is not None:
        history = collect_history(cluster.client, job, store)
        history.save(cluster.tmp / f"history-{job}.json")
        problems = check_history(history, store, expect_state=None, expect_step=steps_total)
        per_node = [step_timeline([log]) for log in cluster.tmp.glob(f"state-*/jobs/{job}/logs/torchrun.log")]
        timeline = merge_timelines(per_node)
        key = (len(cluster.nodes), steps_total)
        table = os.environ.get("MARIND_FAULTS_TABLE")
        if job.startswith("baseline"):
            _BASELINE_SPANS[key] = timeline_span(timeline)
        elif table:                                    # `make chaos`: a row of docs/perf.md's faults table
            scenario = os.environ.get("PYTEST_CURRENT_TEST", job).split("::")[-1].split(" ")[0]
            append_row(table, fault_row(scenario, history, timeline, problems, _BASELINE_SPANS.get(key), again_s=again_s,
                                        steps_lost=steps_run_again(per_node, history.mode)))
        assert not problems, "history violations:\n" + "\n".join(problems)
    return store


ONE_NODE = pytest.param(("a",), id="1x2", marks=pytest.mark.slow)
TWO_NODES = pytest.param(("a", "b"), id="2x2")


_BASELINES: dict[tuple, dict] = {}
_BASELINE_SPANS: dict[tuple, float | None] = {}     # (nodes, steps) -> the fault-free run's first-to-last step


def fault_free_run(cluster: Cluster, steps: int = STEPS, every: int = EVERY) -> dict:
    """``{"objects": final tensor bytes, "losses": {step: loss}}`` of a fault-free run (once per module)."""
    key = (len(cluster.nodes), steps, every)
    if key not in _BASELINES:
        job, url = cluster.submit("baseline", steps=steps, every=every)
        assert cluster.wait_done(job)["state"] == "SUCCEEDED"
        _BASELINES[key] = {"objects": final_tensor_objects(_check_checkpoints(cluster, url, steps), url,
                                                           cluster.s3),
                           "losses": cluster.losses(job)}
    return _BASELINES[key]


def fault_free_final_state(cluster: Cluster) -> dict[str, bytes]:
    """The final checkpoint's tensor bytes of a fault-free run of the spec."""
    return fault_free_run(cluster)["objects"]


def _assert_recovered_once_per_fault(cluster: Cluster, job: str, faults: int, exact: bool = True) -> None:
    """The events record one recovery (a new worker generation on every node) per fault."""
    per_node = cluster.restarts_per_node(job)
    kinds = [e["kind"] for e in cluster.events(job)]
    assert "restart" in kinds, kinds
    for node, count in per_node.items():
        if exact:
            assert count == faults, f"{faults} fault(s) but node {node} restarted {count} time(s): {per_node}"
        else:
            assert count >= faults, f"{faults} fault(s) but node {node} restarted {count} time(s): {per_node}"


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
    _assert_recovered_once_per_fault(cluster, job, faults=len(res.lines))
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline, \
        "after one kill the final state must be bit-identical to the fault-free run"


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_kill_during_a_checkpoint_save(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("kill-saving")
    res = run_injector("kill_random_rank", "--job", job, "--seed", "5", "--during-save",
                       "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix, timeout=240)
    assert res.returncode == 0, res.stderr
    assert len(res.lines) == 1 and res.lines[0]["during_save_step"] > 0
    _finish_like_baseline(cluster, job, url, baseline)
    _assert_recovered_once_per_fault(cluster, job, faults=1)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_two_ranks_killed_at_once(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("two-killed")
    res = run_injector("kill_random_rank", "--job", job, "--seed", "6", "--count", "2",
                       "--after-step", str(EVERY + 2), "--wait", "180", etcd=cluster.etcd,
                       prefix=cluster.prefix, timeout=240)
    assert res.returncode == 0, res.stderr
    assert len({ln["pid"] for ln in res.lines}) == 2
    _finish_like_baseline(cluster, job, url, baseline)
    _assert_recovered_once_per_fault(cluster, job, faults=1)   # killed together: one recovery


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_kill_during_recovery(cluster):
    """A second kill lands while the job is still restarting from the first."""
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("kill-recovering")
    first = run_injector("kill_random_rank", "--job", job, "--seed", "7", "--after-step",
                         str(EVERY + 2), "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix,
                         timeout=240)
    assert first.returncode == 0, first.stderr
    killed = first.lines[0]["pid"]
    # the next generation's workers are up (importing, joining, restoring) but not training yet
    wait_for(lambda: cluster.restarts_per_node(job).get(first.lines[0]["node"], 0) >= 1, 120,
             "the first recovery started", interval=0.1, diag=cluster.diag)
    second = run_injector("kill_random_rank", "--job", job, "--seed", "8", "--wait", "60",
                          etcd=cluster.etcd, prefix=cluster.prefix, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.lines[0]["pid"] != killed
    _finish_like_baseline(cluster, job, url, baseline)
    _assert_recovered_once_per_fault(cluster, job, faults=2, exact=False)


LOSS_TOLERANCE = 0.02   # absolute, on a byte-level LM loss of ~2-5: the same data, another reduction order


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_node_lost_and_returned(cluster):
    """Node b dies: the job goes on with a (world 2); b comes back: it joins again (world 4)."""
    steps = 60
    baseline = fault_free_run(cluster, steps)
    job, url = cluster.submit("node-lost", nodes="1:2", steps=steps)
    wait_for(lambda: cluster.world_size(job) == 4 and cluster.step(job) >= EVERY + 2, 240,
             "training on two nodes", interval=0.2, diag=cluster.diag)
    res = run_injector("kill_node", "--job", job, "--node", "b", "--seed", "9",
                       etcd=cluster.etcd, prefix=cluster.prefix, timeout=60)
    assert res.returncode == 0 and res.lines[0]["node"] == "b", res.stderr
    lost_at = cluster.step(job)
    wait_for(lambda: cluster.world_size(job) == 2 and cluster.step(job) > lost_at, 180,
             "training on node a alone", interval=0.2, diag=cluster.diag)
    cluster.restart_agent("b")
    wait_for(lambda: cluster.world_size(job) == 4, 180, "node b back in the job", interval=0.2,
             diag=cluster.diag)
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    _check_checkpoints(cluster, url, steps)
    events = cluster.events(job)
    assert any(e["kind"] == "node_lost" and e["detail"].get("node") == "b" for e in events), events
    assert sum(e["kind"] == "node_joined" and e["node"] == "b" for e in events) == 2, events
    losses, expected = cluster.losses(job), baseline["losses"]
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)
    worst = max(abs(losses[s] - expected[s]) for s in expected)
    assert worst <= LOSS_TOLERANCE, f"the loss curve left the fault-free one by {worst:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_corrupt_newest_checkpoint_at_restart_falls_back(cluster):
    # the kill must land after the corruption and before the next commit, and before the end: 30
    # steps apart (with 6, a quiet machine ended the 24-step job while the injectors started)
    steps, every = 100, 30
    baseline = fault_free_run(cluster, steps, every)["objects"]
    job, url = cluster.submit("corrupt", steps=steps, every=every)
    wait_for(lambda: cluster.step(job) >= 2 * every + 1 and len(cluster.store(url).steps()) >= 2,
             240, "two committed checkpoints", interval=0.2, diag=cluster.diag)
    opts = json.dumps({"key": ACCESS_KEY, "secret": SECRET_KEY})
    bad = run_injector("corrupt_checkpoint", "--job", job, "--within", "model/", "--chunks-only", "--seed", "2",
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
    assert "ckpt_skip_step" in logs, "the corrupt newest checkpoint must be skipped at restart"
    assert restored and all(r.get("step") != corrupted for r in restored), restored
    store = _check_checkpoints(cluster, url, steps)
    assert final_tensor_objects(store, url, cluster.s3) == baseline


def _finish_like_baseline(cluster: Cluster, job: str, url: str, baseline: dict) -> dict:
    state = cluster.wait_done(job)
    assert state["state"] == "SUCCEEDED", state
    store = _check_checkpoints(cluster, url)
    assert final_tensor_objects(store, url, cluster.s3) == baseline
    return state


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
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
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
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
@pytest.mark.parametrize("cluster", [TWO_NODES], indirect=True)
def test_storage_outage_during_a_save(cluster):
    baseline = fault_free_final_state(cluster)
    job, url = cluster.submit("s3-out")
    opts = json.dumps({"key": ACCESS_KEY, "secret": SECRET_KEY})
    res = run_injector("storage_outage", "--job", job, "--during-save", "--seconds", "5",
                       "--state", str(cluster.s3.state_path), "--storage-options", opts,
                       "--wait", "180", etcd=cluster.etcd, prefix=cluster.prefix, timeout=300)
    assert res.returncode == 0 and res.lines[0].get("during_save_step"), res.stderr
    _finish_like_baseline(cluster, job, url, baseline)

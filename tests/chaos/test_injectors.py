"""Each injector against real processes, real etcd records and real servers.

The fake jobs (tests.chaos.fake_job) are agent -> torchrun -> sleeping
worker trees; their records in etcd follow docs/design.md §2. An injector runs as
``python chaos/NAME.py`` and must signal exactly the process its records
name, on this host, in this job, print one JSON line per action and exit
0 when it acted, 1 when it found nothing.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import s3fs
import torch

from ckpt_store import CheckpointStore
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.netutil import free_port
from marind.testing import procs
from tests.chaos.conftest import REPO, run_injector


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def _wait_status(pid: int, wanted: set[str], timeout: float = 10.0) -> str:
    """The process's status once it is one of ``wanted`` (a signal lands asynchronously)."""
    deadline = time.monotonic() + timeout
    status = _status(pid)
    while status not in wanted and time.monotonic() < deadline:
        time.sleep(0.02)
        status = _status(pid)
    return status


# -- kill_random_rank ---------------------------------------------------------------------------
def test_kill_random_rank_kills_one_worker_of_the_job_only(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2)
    other = fake_node("job-b", "n2", 2)
    res = run_injector("kill_random_rank", "--job", "job-a", "--seed", "3",
                       etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0, res.stderr
    assert len(res.lines) == 1
    line = res.lines[0]
    assert set(line) >= {"action", "target", "pid", "rank", "node", "at"}
    assert line["action"] == "kill" and line["node"] == "n1" and line["signal"] == "SIGKILL"
    assert line["pid"] in a.workers and line["rank"] == a.workers.index(line["pid"])
    assert a.wait_exit(line["pid"]) == -signal.SIGKILL
    survivors = [p for p in a.workers if p != line["pid"]] + other.workers
    assert all(a.alive(p) for p in survivors), "only the chosen worker may be signalled"


def test_kill_random_rank_seeded_choice_is_reproducible(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2, base_rank=0)
    b = fake_node("job-a", "n2", 2, base_rank=2)
    # --signal CONT leaves the workers alive, so the same candidates are there for every run
    picks = [run_injector("kill_random_rank", "--job", "job-a", "--seed", str(seed),
                          "--signal", "CONT", etcd=etcd, prefix=etcd_prefix).lines[0]["rank"]
             for seed in (11, 11, 12, 13, 14, 15)]
    assert picks[0] == picks[1], "the same seed must choose the same rank"
    assert len(set(picks)) > 1, "different seeds should not all choose one rank"
    assert all(x.alive(p) for x in (a, b) for p in x.workers)


def test_kill_random_rank_by_rank_and_two_at_once(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2, base_rank=0)
    b = fake_node("job-a", "n2", 2, base_rank=2)
    res = run_injector("kill_random_rank", "--job", "job-a", "--rank", "3",
                       etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0 and [ln["rank"] for ln in res.lines] == [3]
    assert b.wait_exit(b.workers[1]) == -signal.SIGKILL
    res = run_injector("kill_random_rank", "--job", "job-a", "--count", "2", "--seed", "5",
                       etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0 and len(res.lines) == 2
    killed = {ln["pid"] for ln in res.lines}
    assert len(killed) == 2 and b.workers[1] not in killed
    for pid in killed:
        assert (a if pid in a.workers else b).wait_exit(pid) == -signal.SIGKILL


def test_kill_random_rank_during_save_waits_for_a_save_to_start(etcd, etcd_client, etcd_prefix,
                                                                 fake_node, tmp_path):
    root = tmp_path / "ckpt"
    (root / "step-0000000004").mkdir(parents=True)        # an old failed save: not "in progress"
    etcd_client.put_json(etcd_client.key("jobs", "job-s", "spec"),
                         {"job": {"name": "s"}, "checkpoint": {"url": f"file://{root}"}})
    a = fake_node("job-s", "n1", 2)
    proc = procs.spawn([sys.executable, str(REPO / "chaos" / "kill_random_rank.py"), "--job", "job-s",
                        "--during-save", "--wait", "60", "--seed", "1", "--etcd", etcd.endpoint,
                        "--prefix", etcd_prefix], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "waiting_for_save" in line:
            break
    time.sleep(0.5)
    assert all(a.alive(p) for p in a.workers), "nothing may be signalled before a save starts"
    (root / "step-0000000008" / "model").mkdir(parents=True)   # a save starts
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [line] = [json.loads(x) for x in out.splitlines()]
    assert line["action"] == "kill" and line["during_save_step"] == 8
    assert a.wait_exit(line["pid"]) == -signal.SIGKILL


def test_kill_random_rank_finds_nothing_elsewhere(etcd, etcd_prefix, fake_node):
    remote = fake_node("job-r", "n9", 1, host="some-other-host")
    res = run_injector("kill_random_rank", "--job", "job-r", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 1 and res.lines == [], "a record of another host is not ours"
    res = run_injector("kill_random_rank", "--job", "no-such-job", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 1 and res.lines == []
    assert remote.alive(remote.workers[0])


def test_kill_random_rank_refuses_a_pid_that_is_not_the_records_worker(
        etcd, etcd_client, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 1)
    bystander = fake_node("job-x", "n2", 1, publish=False)
    key = etcd_client.key("jobs", "job-a", "nodes", "n1")
    rec = etcd_client.get_json(key)
    rec["workers"] = [{"rank": 0, "local_rank": 0, "pid": bystander.workers[0]}]  # a reused pid
    etcd_client.put_json(key, rec)
    res = run_injector("kill_random_rank", "--job", "job-a", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 1
    assert bystander.alive(bystander.workers[0]) and a.alive(a.workers[0])


def test_kill_random_rank_waits_for_a_target_and_exit_codes(etcd, etcd_prefix, fake_node):
    res = run_injector("kill_random_rank", "--job", "job-a", "--signal", "NOPE",
                       etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 2 and "unknown signal" in res.stderr
    res = run_injector("kill_random_rank", "--job", "job-a", "--etcd", "http://127.0.0.1:1",
                       timeout=60)
    assert res.returncode == 3 and "etcd unreachable" in res.stderr


# -- kill_node -------------------------------------------------------------------------------------
def test_kill_node_kills_the_agent_and_its_whole_tree(etcd, etcd_prefix, fake_node):
    n1 = fake_node("job-a", "n1", 2, base_rank=0)
    n2 = fake_node("job-a", "n2", 2, base_rank=2)
    other = fake_node("job-b", "n3", 1)
    res = run_injector("kill_node", "--job", "job-a", "--node", "n2", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0, res.stderr
    [line] = res.lines
    assert line["action"] == "kill_node" and line["node"] == "n2" and line["pid"] == n2.agent_pid
    assert set(line["killed"]) == {n2.agent_pid, n2.torchrun_pid, *n2.workers}
    assert n2.proc.wait(10) == -signal.SIGKILL
    for pid in [n2.torchrun_pid, *n2.workers]:
        assert not n2.alive(pid)
    for pid in [n1.agent_pid, n1.torchrun_pid, *n1.workers, other.agent_pid, *other.workers]:
        assert n1.alive(pid), "other nodes and other jobs must survive"


def test_kill_node_seeded_and_nothing_to_kill(etcd, etcd_prefix, fake_node):
    res = run_injector("kill_node", "--job", "job-a", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 1 and res.lines == []
    nodes = {n: fake_node("job-a", n, 1) for n in ("n1", "n2", "n3")}
    res = run_injector("kill_node", "--job", "job-a", "--seed", "21", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0
    chosen = res.lines[0]["node"]
    assert nodes[chosen].proc.wait(10) == -signal.SIGKILL
    assert all(f.proc.poll() is None for n, f in nodes.items() if n != chosen)


# -- hang_rank -------------------------------------------------------------------------------------
def test_hang_rank_stops_then_continues(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2)
    cmd_args = ("--job", "job-a", "--rank", "1", "--seconds", "2")
    proc = procs.spawn([sys.executable, str(REPO / "chaos" / "hang_rank.py"), *cmd_args,
                        "--etcd", etcd.endpoint, "--prefix", etcd_prefix],
                       stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert '"hang"' in first, first
    pid = a.workers[1]
    assert _wait_status(pid, {psutil.STATUS_STOPPED}) == psutil.STATUS_STOPPED
    assert _status(a.workers[0]) != psutil.STATUS_STOPPED
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and '"resume"' in out
    running = {psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING}
    assert _wait_status(pid, running) in running


def test_hang_rank_for_good(etcd, etcd_prefix, fake_node):
    a = fake_node("job-a", "n1", 2)
    res = run_injector("hang_rank", "--job", "job-a", "--seed", "1", etcd=etcd, prefix=etcd_prefix)
    assert res.returncode == 0 and [ln["action"] for ln in res.lines] == ["hang"]
    assert _wait_status(res.lines[0]["pid"], {psutil.STATUS_STOPPED}) == psutil.STATUS_STOPPED
    assert res.lines[0]["pid"] in a.workers


# -- etcd_outage -----------------------------------------------------------------------------------
def test_etcd_outage_stops_and_restarts_on_the_same_data(etcd_private):
    client = EtcdClient(etcd_private.endpoint, prefix="/p")
    client.put_json(client.key("jobs", "job-a", "state"), {"state": "RUNNING"})
    old_pid = etcd_private.pid
    proc = procs.spawn([sys.executable, str(REPO / "chaos" / "etcd_outage.py"), "--job", "job-a",
                        "--etcd", etcd_private.endpoint, "--prefix", "/p",
                        "--state", str(etcd_private.state_path), "--seconds", "1.5"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop_line = json.loads(proc.stdout.readline())
    assert stop_line["action"] == "stop_server" and stop_line["pid"] == old_pid
    with pytest.raises(ControlPlaneUnavailable):
        EtcdClient(etcd_private.endpoint, prefix="/p", timeout=1).get(client.key("jobs"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    start_line = json.loads(out.splitlines()[-1])
    assert start_line["action"] == "start_server" and start_line["pid"] != old_pid
    client = EtcdClient(etcd_private.endpoint, prefix="/p")
    assert client.get_json(client.key("jobs", "job-a", "state")) == {"state": "RUNNING"}
    assert etcd_private.running and etcd_private.pid == start_line["pid"], "owner adopts the new pid"

    # without a state file the server is found as the listener of the endpoint
    res = run_injector("etcd_outage", "--seconds", "0", "--etcd", etcd_private.endpoint)
    assert res.returncode == 0, res.stderr
    assert [ln["action"] for ln in res.lines] == ["stop_server", "start_server"]
    client = EtcdClient(etcd_private.endpoint, prefix="/p")
    assert client.get_json(client.key("jobs", "job-a", "state")) == {"state": "RUNNING"}
    new_pid = res.lines[1]["pid"]
    etcd_private.stop()
    assert not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == "zombie"


def test_etcd_outage_refuses_an_unknown_job(etcd_private):
    res = run_injector("etcd_outage", "--job", "ghost", "--etcd", etcd_private.endpoint,
                       "--state", str(etcd_private.state_path))
    assert res.returncode == 1 and res.lines == []
    assert etcd_private.running


# -- storage_outage --------------------------------------------------------------------------------
def test_storage_outage_during_save_then_back_with_data(s3_private, tmp_path):
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_private.storage_options)
    root = f"{s3_private.bucket}/run/ckpt"
    fs.pipe(f"{root}/step-0000000010/model/w/c/0", b"old")
    fs.pipe(f"{root}/step-0000000010/manifest.json", b"{}")
    opts = json.dumps({"key": s3_private.storage_options["key"],
                       "secret": s3_private.storage_options["secret"]})
    old_pid = s3_private.pid
    proc = procs.spawn([sys.executable, str(REPO / "chaos" / "storage_outage.py"),
                        "--state", str(s3_private.state_path), "--seconds", "1", "--during-save",
                        "--url", f"s3://{root}", "--storage-options", opts, "--wait", "60"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:                      # baseline taken: now a save "starts"
        if "waiting_for_save" in line:
            break
    fs.pipe(f"{root}/step-0000000020/model/w/c/0", b"new")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [ln["action"] for ln in lines] == ["stop_server", "start_server"]
    assert lines[0]["during_save_step"] == 20 and lines[0]["pid"] == old_pid
    assert s3_private.running and s3_private.pid == lines[1]["pid"] != old_pid
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_private.storage_options)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert fs.cat(f"{root}/step-0000000010/model/w/c/0") == b"old"
            assert fs.cat(f"{root}/step-0000000020/model/w/c/0") == b"new"
            break
        except (OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_storage_outage_without_a_server_finds_nothing(tmp_path):
    res = run_injector("storage_outage", "--endpoint", f"http://127.0.0.1:{free_port()}")
    assert res.returncode == 1 and res.lines == []


# -- corrupt_checkpoint ----------------------------------------------------------------------------
def _saved_store(root: Path) -> CheckpointStore:
    store = CheckpointStore(f"file://{root}")
    gen = torch.Generator().manual_seed(0)
    for step in (10, 20):
        state = {"model": {"a.weight": torch.randn(64, 32, generator=gen),
                           "b.bias": torch.randn(128, generator=gen)},
                 "extra": {"step": step}}
        store.save(step, state, async_=False).wait()
    return store


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupt_checkpoint_newest_is_caught_by_verify(tmp_path, mode):
    store = _saved_store(tmp_path / "ckpt")
    assert store.steps() == [10, 20] and store.verify(20).ok
    res = run_injector("corrupt_checkpoint", "--url", f"file://{tmp_path / 'ckpt'}",
                       "--mode", mode, "--seed", "4")
    assert res.returncode == 0, res.stderr
    [line] = res.lines
    assert line["action"] == "corrupt" and line["step"] == 20 and line["mode"] == mode
    path = tmp_path / "ckpt" / "step-0000000020" / line["key"]
    size = store.manifest(20)["objects"][line["key"]]["size"]
    if mode == "truncate":
        assert path.stat().st_size == size // 2
    else:
        assert path.stat().st_size == size and len(line["offsets"]) == 8
    report = CheckpointStore(f"file://{tmp_path / 'ckpt'}").verify(20)
    assert not report.ok and any(line["key"] in p for p in report.problems)
    assert CheckpointStore(f"file://{tmp_path / 'ckpt'}").verify(10).ok, "older steps untouched"


def test_corrupt_checkpoint_seeded_and_nothing_to_corrupt(tmp_path):
    picks = []
    for copy in ("c1", "c2"):
        _saved_store(tmp_path / copy)
        res = run_injector("corrupt_checkpoint", "--url", f"file://{tmp_path / copy}", "--seed", "9")
        assert res.returncode == 0, res.stderr
        picks.append((res.lines[0]["key"], res.lines[0]["offsets"]))
    assert picks[0] == picks[1], "the same seed must corrupt the same bytes of the same object"
    (tmp_path / "empty" / "step-0000000030").mkdir(parents=True)   # a save without its manifest
    res = run_injector("corrupt_checkpoint", "--url", f"file://{tmp_path / 'empty'}")
    assert res.returncode == 1 and res.lines == []


def test_corrupt_checkpoint_chunks_only_damages_what_a_load_reads(tmp_path):
    store = _saved_store(tmp_path / "ckpt")
    objects = store.manifest(20)["objects"]
    assert any(k.endswith("zarr.json") for k in objects if k.startswith("model/"))    # what it must skip
    for seed in range(6):
        res = run_injector("corrupt_checkpoint", "--url", f"file://{tmp_path / 'ckpt'}", "--within", "model/",
                           "--chunks-only", "--seed", str(seed))
        assert res.returncode == 0, res.stderr
        key = res.lines[0]["key"]
        assert key.startswith("model/") and "/c/" in key and "chunks_crc32c" in objects[key], key

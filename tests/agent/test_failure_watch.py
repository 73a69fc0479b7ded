"""The first failed rank named with its own cause, from torchrun's log as real runs print it (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from marind.agent.failure_watch import FailureWatch
from marind.agent.oom_watch import OomWatch
from marind.agent.supervisor import WorkerProc
from tests.control.test_failure_causes import GLOO_PEER, GLOO_TIMEOUT

pytestmark = pytest.mark.unit

FAILED = ("E1207 09:49:15.024000 29840 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
          "(exitcode: {code}) local_rank: {local} (pid: {pid}) of binary: /usr/bin/python\n")


def traceback(rank: int | None, error: str) -> str:
    """A worker's traceback as torch prints it: ``[rankN]:`` on every line once its process group is up."""
    pre = f"[rank{rank}]: " if rank is not None else ""
    return (f"{pre}Traceback (most recent call last):\n{pre}  File \"/w/train.py\", line 40, in <module>\n"
            f"{pre}    dist.all_reduce(t)\n{pre}{error}\n")


def watch(tmp_path: Path, oom_root: Path | None = None) -> FailureWatch:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "torchrun.log").write_text("")
    oom = OomWatch(root=oom_root or tmp_path / "nocg", proc=tmp_path / "proc", kmsg=None)
    w = FailureWatch("node-a", tmp_path, 0, oom)
    w.note([WorkerProc(501, 0, 0, 601), WorkerProc(502, 1, 1, 602)])
    return w


def log(tmp_path: Path, text: str) -> None:
    with open(tmp_path / "logs" / "torchrun.log", "a") as fh:
        fh.write(text)


def test_a_sigkilled_rank_is_named_not_the_peer_that_saw_it_go(tmp_path):
    """The README trial: rank 1 SIGKILLed; rank 0 printed gloo's "Connection closed by peer" first."""
    w = watch(tmp_path)
    log(tmp_path, traceback(0, GLOO_PEER) + FAILED.format(code=-9, local=1, pid=602))
    [(failure, cause, facts)] = w.read()
    assert cause.kind == "killed" and cause.what == "rank 1 (local 1) on node-a was killed by SIGKILL (pid 502)"
    assert (facts["rank"], facts["local_rank"], facts["exitcode"], facts["cause"]) == (1, 1, -9, "killed")
    assert w.last_reason() == cause.line


def test_an_echo_named_by_torchrun_gives_way_to_the_rank_that_failed_on_its_own(tmp_path):
    """torchrun saw rank 0 (exit 1: a peer gone) first; rank 1 raised its own error before it died."""
    w = watch(tmp_path)
    log(tmp_path, traceback(1, "ValueError: batch 17 has no labels") + traceback(0, GLOO_PEER)
        + FAILED.format(code=1, local=0, pid=601))
    [(_, cause, facts)] = w.read()
    assert cause.kind == "error" and cause.what == "rank 1 (local 1) on node-a: ValueError: batch 17 has no labels"
    assert facts["rank"] == 1 and "its peer at 127.0.0.1 went away" in facts["echo_of"]


def test_an_echo_gives_way_to_an_oom_killed_rank(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (root / "memory" / "w").mkdir(parents=True)
    (root / "memory" / "w" / "memory.oom_control").write_text("oom_kill 0\n")
    (proc / "502").mkdir(parents=True)
    (proc / "502" / "cgroup").write_text("4:memory:/w\n")
    (proc / "502" / "stat").write_text("502 (python) S 1 1 1 0 -1 0\n")
    w = watch(tmp_path, root)
    (root / "memory" / "w" / "memory.oom_control").write_text("oom_kill 1\n")      # the kernel killed it
    log(tmp_path, traceback(0, GLOO_PEER) + FAILED.format(code=1, local=0, pid=601))
    [(_, cause, facts)] = w.read()
    assert cause.kind == "oom_killed" and cause.what.startswith("rank 1 (local 1) on node-a was killed by the "
                                                                "kernel's OOM killer")
    assert (facts["rank"], facts["exitcode"]) == (1, -9)


def test_an_echo_with_no_cause_here_stays_an_echo(tmp_path):
    w = watch(tmp_path)
    log(tmp_path, traceback(0, GLOO_PEER) + FAILED.format(code=1, local=0, pid=601))
    [(_, cause, facts)] = w.read()
    assert cause.kind == "peer_lost" and facts["echo"] is True and facts["rank"] == 0


def test_a_timeout_names_the_rank_that_did_not_time_out(tmp_path):
    w = watch(tmp_path)
    log(tmp_path, traceback(0, GLOO_TIMEOUT) + FAILED.format(code=1, local=0, pid=601))
    [(_, cause, _)] = w.read()
    assert cause.kind == "collective_timeout" and "rank 1 stopped answering" in cause.what
    log(tmp_path, traceback(0, GLOO_TIMEOUT) + traceback(1, GLOO_TIMEOUT) + FAILED.format(code=1, local=0, pid=601))
    [(_, cause, _)] = w.read()
    assert "a rank on another node stopped answering" in cause.what       # both ranks here waited


def test_an_error_before_the_process_group_is_the_failed_ranks_own(tmp_path):
    w = watch(tmp_path)
    log(tmp_path, traceback(None, "FileNotFoundError: [Errno 2] No such file or directory: 'data/x.idx'")
        + FAILED.format(code=1, local=1, pid=602))
    [(_, cause, _)] = w.read()
    assert cause.kind == "data_missing" and cause.what.startswith("rank 1 (local 1) on node-a: FileNotFoundError")


JOINED = ('{{"logger": "marind.rendezvous.etcd3_handler", "run_id": "j", "node": "n_1_0", "round": {round}, '
          '"rank": {group}, "world_size": 2, "event": "rdzv_joined", "level": "info"}}\n')


def test_a_worker_that_died_before_the_agent_saw_it_is_named_from_the_rounds_group_rank(tmp_path):
    """The agent never saw the worker (it failed at once): its global rank is group rank x nproc + local."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun.log").write_text("")
    w = FailureWatch("node-b", tmp_path, 0, OomWatch(root=tmp_path / "nocg", proc=tmp_path / "proc", kmsg=None),
                     nproc_per_node=2)
    log(tmp_path, JOINED.format(round=0, group=1)
        + traceback(None, "FileNotFoundError: [Errno 2] No such file or directory: 'data/x.idx'")
        + FAILED.format(code=1, local=1, pid=702))
    [(failure, cause, facts)] = w.read()
    assert failure.group_rank == 1 and facts["rank"] == 3
    assert cause.kind == "data_missing" and cause.what.startswith("rank 3 (local 1) on node-b: FileNotFoundError")


def test_without_the_nodes_process_count_an_unseen_worker_stays_a_local_rank(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun.log").write_text("")
    w = FailureWatch("node-b", tmp_path, 0, OomWatch(root=tmp_path / "nocg", proc=tmp_path / "proc", kmsg=None))
    log(tmp_path, JOINED.format(round=0, group=1) + FAILED.format(code=1, local=1, pid=702))
    [(_, cause, facts)] = w.read()
    assert facts["rank"] is None and cause.what == "local rank 1 on node-b ended with exit code 1"

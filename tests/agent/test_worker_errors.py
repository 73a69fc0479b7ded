"""Why workers failed, from torchrun.log and torchelastic's error file: pure parsing, no processes."""

from __future__ import annotations

import json
import os
import time

import pytest

from marind.agent.decisions import failure_restarts
from marind.agent.metrics import Metrics
from marind.agent.registry import may_take_over
from marind.agent.worker_errors import (
    MAX_LINE,
    LogScan,
    LogTail,
    clean_line,
    describe_exit,
    error_file_line,
    exception_line,
    read_error_file,
)

pytestmark = pytest.mark.unit

TRACEBACK = """Traceback (most recent call last):
  File "/x/marind/zygote.py", line 158, in _run_worker
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
  File "/x/train.py", line 32, in main
    with open(data, "rb"):
         ^^^^^^^^^^^^^^^^
FileNotFoundError: [Errno 2] No such file or directory: 'data/example.idx'
"""
FAILED = ("E1205 12:15:39.238000 27595 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
          "(exitcode: {code}) local_rank: 0 (pid: {pid}) of binary: /usr/bin/python\n")
TORCHRUN_GIVES_UP = """Traceback (most recent call last):
  File "/venv/torch/distributed/run.py", line 1028, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
============================================================
train FAILED
Root Cause (first observed failure):
  exitcode  : 1 (pid: 5208)
  error_file: <N/A>
"""
MISSING = "FileNotFoundError: [Errno 2] No such file or directory: 'data/example.idx'"


def test_each_failed_round_carries_the_error_printed_before_it():
    scan = LogScan()
    found = scan.feed('{"event": "rdzv_etcd3"}\n' + TRACEBACK + TRACEBACK + FAILED.format(code=1, pid=11))
    assert [(f.exitcode, f.pid, f.error) for f in found] == [(1, 11, MISSING)]
    found = scan.feed(FAILED.format(code=-9, pid=12))            # a round killed without a traceback
    assert found[0].error is None and found[0].reason == "worker local_rank 0 killed by SIGKILL"
    found = scan.feed(TRACEBACK + FAILED.format(code=1, pid=13) + TORCHRUN_GIVES_UP)
    assert found[0].reason == MISSING
    assert len(scan.failures) == 3 and scan.last_error == MISSING    # torchrun's own error is not a reason


def test_a_line_cut_between_two_reads_is_joined():
    scan = LogScan()
    text = TRACEBACK + FAILED.format(code=1, pid=7)
    cut = text.index("No such file")
    assert scan.feed(text[:cut]) == []
    assert [f.error for f in scan.feed(text[cut:])] == [MISSING]


def test_chained_and_prefixed_tracebacks_give_the_last_exception():
    text = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"a.py\", line 1, in f\n"
            "[rank1]: KeyError: 'x'\n\nDuring handling of the above exception, another exception occurred:\n\n"
            "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"a.py\", line 3, in f\n"
            "[rank1]: RuntimeError: dataset shard 3 is missing\n" + FAILED.format(code=1, pid=5))
    assert LogScan().feed(text)[0].error == "RuntimeError: dataset shard 3 is missing"


@pytest.mark.parametrize(("line", "expected"), [
    ("ValueError: bad", "ValueError: bad"),
    ("KeyboardInterrupt", "KeyboardInterrupt"),
    ("torch.distributed.DistBackendError: NCCL error", "torch.distributed.DistBackendError: NCCL error"),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", None),
    ("  File \"x.py\", line 1", None),
    ("some words: not an exception", None),
    ("", None),
])
def test_exception_line(line, expected):
    assert exception_line(line) == expected


def test_helpers():
    assert clean_line("[default3]:ValueError: x\n") == "ValueError: x"
    assert describe_exit(1) == "exit code 1" and describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(-200) == "killed by signal 200"
    assert len(exception_line("ValueError: " + "x" * 1000) or "") == MAX_LINE


def test_error_file_formats(tmp_path):
    assert error_file_line({"message": {"message": "ValueError: boom\nmore", "extraInfo": {}}}) == "ValueError: boom"
    assert error_file_line({"message": "OSError: disk"}) == "OSError: disk"
    assert error_file_line({"message": {"extraInfo": {}}}) is None and error_file_line([1]) is None
    path = tmp_path / "error.json"
    assert read_error_file(path, 0.0) is None
    path.write_text(json.dumps({"message": {"message": MISSING}}))
    assert read_error_file(path, 0.0) == MISSING
    old = time.time() - 100
    os.utime(path, (old, old))
    assert read_error_file(path, time.time() - 10) is None          # a previous run's file
    path.write_text("{half")
    assert read_error_file(path, 0.0) is None


def test_log_tail_reads_what_was_appended(tmp_path):
    path = tmp_path / "torchrun.log"
    path.write_text("earlier run\n")
    tail = LogTail(path, path.stat().st_size)
    assert tail.read() == ""
    with open(path, "a") as fh:
        fh.write("new line\n")
    assert tail.read() == "new line\n" and tail.read() == ""
    path.write_text("x\n")                                            # replaced: from the start
    assert tail.read() == "x\n"
    assert LogTail(tmp_path / "absent.log").read() == ""


def test_who_may_take_a_node_name():
    holder = {"host": "h1", "pid": 100, "started_at": 5.0}
    assert may_take_over(holder, host="h2", pid=1, alive=lambda p, t: False) == (
        False, "it runs on another host (h1)")
    assert may_take_over(holder, host="h1", pid=1, alive=lambda p, t: True)[0] is False
    assert may_take_over(holder, host="h1", pid=1, alive=lambda p, t: False) == (
        True, "the previous agent on this host (pid 100) is gone")
    assert may_take_over(holder, host="h1", pid=100, alive=lambda p, t: True)[0] is True   # its own record
    assert may_take_over({"host": "h1"}, host="h1", pid=1, alive=lambda p, t: False)[0] is False


def test_per_job_series_go_with_the_job():
    m = Metrics()
    m.set("marind_job_step", 7, job="a")
    m.set("marind_job_restarts_total", 2, job="a")
    m.observe("marind_checkpoint_duration_seconds", 0.3, job="a")
    m.set("marind_job_step", 1, job="b")
    text = m.render()
    assert 'marind_job_step{job="a"} 7' in text and 'marind_job_restarts_total{job="a"} 2' in text
    assert 'marind_checkpoint_duration_seconds_count{job="a"} 1' in text
    m.remove_job("a")
    text = m.render()
    assert 'job="a"' not in text and 'marind_job_step{job="b"} 1' in text
    m.remove_job("b")
    assert "\nmarind_job_restarts_total 0" not in m.render()     # no unlabelled zero for a per-job counter


def test_a_restart_follows_the_first_max_restarts_failures():
    assert [failure_restarts(n, 2)[0] for n in (1, 2, 3, 4)] == [True, True, False, False]
    assert failure_restarts(1, 0) == (False, "failure 1 after 0 restarts: torchrun gives up")

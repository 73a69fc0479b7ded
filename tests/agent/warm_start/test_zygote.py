"""Warm starts: the zygote forks workers for stubs; the stub is the worker as torchrun sees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest

from marind.agent.warm_start.zygote import read_pid_map
from marind.testing.procs import base_env, spawn
from tests.agent.helpers import wait_for

WORKER = "tests.agent.zygote_worker"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One zygote for the module (it imports torch once, as on a node); stopped at the end."""
    name = f"@marind-zygote-test-{uuid.uuid4().hex[:8]}"
    pids = tmp_path_factory.mktemp("zygote") / "zygote.pids.json"
    proc = subprocess.Popen([sys.executable, "-m", "marind.agent.warm_start.zygote", name, str(pids), "tests.agent", str(os.getpid())],
                            env=base_env())
    env = base_env({"MARIND_ZYGOTE_SOCKET": name, "MARIND_ZYGOTE_WAIT": "60", "RANK": "3"})
    yield proc, env, pids
    proc.kill()
    proc.wait(10)


def _stub(env, *args, **kw):
    return spawn([sys.executable, "-m", "marind.agent.warm_start.zygote_stub", WORKER, *args], env=env,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _pid_of(line: str) -> int:
    return int(line.split()[0].removeprefix("pid="))


def test_a_forked_worker_gets_the_stubs_env_cwd_stdio_and_exit_code(zygote, tmp_path):
    proc, env, pids = zygote
    stub = _stub(env, "exit", "7", cwd=tmp_path)
    out, err = stub.communicate(timeout=120)
    assert stub.returncode == 7, err
    line = out.splitlines()[0]
    assert _pid_of(line) != stub.pid, "the worker must be the zygote's fork, not the stub"
    assert f"rank=3 cwd={tmp_path}" in line
    # a session of its own, like a cold worker's (autogroup scheduling shares CPU between sessions)
    assert f"sid={_pid_of(line)}" in line and os.getsid(proc.pid) != _pid_of(line)
    assert psutil.Process(proc.pid).is_running()


def test_an_uncaught_exception_is_printed_and_exits_1(zygote):
    _, env, _ = zygote
    stub = _stub(env, "raise")
    _, err = stub.communicate(timeout=120)
    assert stub.returncode == 1 and "RuntimeError: boom from the worker" in err


def test_signals_are_forwarded_and_a_killed_worker_kills_its_stub(zygote):
    _, env, pids = zygote
    stub = _stub(env, "sleep")
    worker = _pid_of(stub.stdout.readline())
    assert wait_for(lambda: read_pid_map(pids).get(stub.pid) == worker, 30, "the pid map")
    stub.send_signal(signal.SIGTERM)                 # as torchrun stops its workers
    assert stub.stdout.readline().strip() == "term"
    assert stub.wait(30) == 143

    stub = _stub(env, "sleep")
    worker = _pid_of(stub.stdout.readline())
    os.kill(worker, signal.SIGKILL)                  # a chaos injector kills the real worker
    assert stub.wait(30) == -signal.SIGKILL, "torchrun must see the worker's death by SIGKILL"
    assert wait_for(lambda: stub.pid not in read_pid_map(pids), 30, "the pid map to drop it")


def test_a_killed_stub_takes_its_worker_down(zygote):
    _, env, pids = zygote
    stub = _stub(env, "sleep")
    worker = psutil.Process(_pid_of(stub.stdout.readline()))
    assert wait_for(lambda: read_pid_map(pids).get(stub.pid) == worker.pid, 30, "the pid map")
    stub.kill()
    assert stub.wait(10) == -signal.SIGKILL
    worker.wait(10)                                  # the lifeline broke: the worker killed itself
    assert not worker.is_running()
    assert wait_for(lambda: stub.pid not in read_pid_map(pids), 30, "the zygote to reap the worker")


def test_no_zygote_means_a_cold_start(tmp_path):
    env = base_env({"MARIND_ZYGOTE_SOCKET": f"@nobody-{uuid.uuid4().hex[:8]}", "MARIND_ZYGOTE_WAIT": "0.2"})
    stub = _stub(env, "exit", "5")
    out, err = stub.communicate(timeout=120)
    assert stub.returncode == 5 and "cold start" in err
    assert _pid_of(out.splitlines()[0]) == stub.pid, "cold: the stub execs into the worker"


def test_the_zygote_leaves_when_its_parent_does(tmp_path):
    name = f"@marind-zygote-test-{uuid.uuid4().hex[:8]}"
    code = (f"import subprocess, sys, os; p = subprocess.Popen([sys.executable, '-m', 'marind.agent.warm_start.zygote', "
            f"'{name}', '{tmp_path}/p.json', 'tests.agent', str(os.getpid())]); print(p.pid, flush=True); "
            f"import time; time.sleep(60)")
    parent = spawn([sys.executable, "-c", code], env=base_env(), stdout=subprocess.PIPE, text=True)
    zyg = psutil.Process(int(parent.stdout.readline()))
    assert wait_for(lambda: _listening(name), 60, "the zygote to listen")
    assert zyg.is_running() and zyg.ppid() == parent.pid
    parent.kill()
    assert parent.wait(10) == -signal.SIGKILL
    zyg.wait(30)                                     # psutil.TimeoutExpired if it stayed
    assert not zyg.is_running()
    assert not _listening(name), "the zygote's socket must go with it"


def _listening(name: str) -> bool:
    """Is an abstract unix socket ``@name`` bound (``/proc/net/unix`` lists it with its '@')?"""
    with open("/proc/net/unix") as f:
        return any(line.rstrip().endswith(" " + name) for line in f)


# A script without a main guard: its top level is the program. The zygote must never run it.
UNGUARDED = """
import os, sys
with open(sys.argv[1], "a") as fh:
    fh.write(f"{os.getpid()} {os.getcwd()}\\n")
print(f"pid={os.getpid()} argv={sys.argv[1:]}", flush=True)
sys.exit(int(sys.argv[2]))
"""


def test_a_script_without_a_main_guard_runs_once_per_worker_and_never_in_the_zygote(zygote, tmp_path):
    proc, env, pids = zygote
    (tmp_path / "prog.py").write_text(UNGUARDED)
    starts = tmp_path / "starts.log"
    workers = []
    for code in ("0", "3"):
        stub = spawn([sys.executable, "-m", "marind.agent.warm_start.zygote_stub", "--command", "python", "prog.py", str(starts), code],
                     env={**env, "MARIND_WORKING_DIR": str(tmp_path)}, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        out, err = stub.communicate(timeout=120)
        assert stub.returncode == int(code) and "cold start" not in err, err
        worker = _pid_of(out.splitlines()[0])
        assert worker != stub.pid and f"argv=['{starts}', '{code}']" in out
        assert psutil.Process(proc.pid).is_running()
        workers.append(worker)
    lines = starts.read_text().splitlines()
    assert lines == [f"{w} {tmp_path}" for w in workers], "exactly one top-level run per start, in the worker"


def test_a_missing_working_dir_is_one_line_and_exit_2(tmp_path):
    env = base_env({"MARIND_WORKING_DIR": str(tmp_path / "gone")})
    stub = _stub(env, "exit", "0")
    _, err = stub.communicate(timeout=120)
    assert stub.returncode == 2 and err.count("\n") == 1 and f"job.working_dir {tmp_path / 'gone'}" in err


def test_a_failed_preload_sends_every_stub_to_a_cold_start_at_once(tmp_path):
    name = f"@marind-zygote-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-m", "marind.agent.warm_start.zygote", name, str(tmp_path / "p.json"),
                             "tests.agent,no_such_module_xyz", str(os.getpid())], env=base_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        # a stub that waited out MARIND_ZYGOTE_WAIT would sit here for an hour: it is told instead
        env = base_env({"MARIND_ZYGOTE_SOCKET": name, "MARIND_ZYGOTE_WAIT": "3600", "RANK": "1"})
        for _ in range(2):
            stub = _stub(env, "exit", "4")
            out, err = stub.communicate(timeout=120)
            assert stub.returncode == 4, err
            assert "cold start (the zygote could not preload" in err and "no_such_module_xyz" in err, err
            assert _pid_of(out.splitlines()[0]) == stub.pid, "cold: the stub execs into the worker"
        assert proc.poll() is None, "a refusing zygote keeps answering"
    finally:
        proc.kill()
        _, zerr = proc.communicate(timeout=10)
    assert "no_such_module_xyz" in zerr and "workers start cold" in zerr

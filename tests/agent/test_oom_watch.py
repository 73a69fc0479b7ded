"""Telling the kernel's OOM killer from another SIGKILL: the cgroup files' parsers, and a real OOM kill."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from marind.agent.oom_watch import OomWatch, cgroup_dir, kmsg_killed, limit_bytes, memory_cgroup, oom_kills
from marind.control.failure_causes import cause_of
from marind.testing.procs import spawn

V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n"
KMSG = ["6,1234,567890,-;python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
        "3,1240,567899,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:1200000kB, "
        "anon-rss:262000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:700kB oom_score_adj:0",
        "6,1241,567899,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/x,task_memcg=/x,task=python,pid=5151,uid=0"]


@pytest.mark.unit
def test_parsers():
    assert memory_cgroup("9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n") == ("v1", "/process_api/abc")
    assert memory_cgroup("4:cpu,memory:/a\n") == ("v1", "/a")
    assert memory_cgroup("0::/user.slice/job.scope\n") == ("v2", "/user.slice/job.scope")
    assert memory_cgroup("") is None
    assert cgroup_dir("v1", "/a/b", Path("/r")) == Path("/r/memory/a/b")
    assert cgroup_dir("v2", "/a/b", Path("/r")) == Path("/r/a/b")
    assert oom_kills(V1_OOM_CONTROL) == 2 and oom_kills(V2_EVENTS) == 1 and oom_kills("under_oom 0\n") is None
    assert limit_bytes("268435456\n") == 256 << 20
    assert limit_bytes("9223372036854771712\n") is None and limit_bytes("max\n") is None
    assert kmsg_killed(KMSG, 4242) and kmsg_killed(KMSG, 5151) and not kmsg_killed(KMSG, 4243)


@pytest.mark.unit
def test_counts_noted_while_alive_tell_an_oom_kill(tmp_path):
    """The watch on files laid out as /proc and a v1 memory cgroup are: the count moved, so the OOM killer."""
    proc, root = tmp_path / "proc", tmp_path / "cg"
    cg = root / "memory" / "jobs" / "j1"
    cg.mkdir(parents=True)
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text("4:memory:/jobs/j1\n")
    (proc / "4242" / "stat").write_text("4242 (python) S 1 4242 4242 0 -1 4194560\n")
    (cg / "memory.oom_control").write_text(V1_OOM_CONTROL)
    (cg / "memory.failcnt").write_text("7\n")
    (cg / "memory.limit_in_bytes").write_text(str(512 << 20))
    (cg / "memory.max_usage_in_bytes").write_text(str(510 << 20))
    watch = OomWatch(root=root, proc=proc, kmsg=None)
    watch.note([4242])
    assert watch.evidence(4242) is None                     # nothing moved: a SIGKILL from someone else
    (cg / "memory.oom_control").write_text(V1_OOM_CONTROL.replace("oom_kill 2", "oom_kill 3"))
    ev = watch.evidence(4242)
    assert ev is not None and (ev.source, ev.cgroup, ev.limit_bytes, ev.peak_bytes, ev.kills) == (
        "cgroup", "/jobs/j1", 512 << 20, 510 << 20, 1)
    assert watch.evidence(999) is None                       # never noted, no kernel log
    (proc / "4242" / "cgroup").write_text("4:memory:/\n")                  # exited: the root cgroup shows
    (proc / "4242" / "stat").write_text("4242 (python) Z 1 4242 4242 0 -1 4227084\n")
    watch.note([4242])
    assert watch.evidence(4242) is not None                  # still judged where it lived


@pytest.mark.timeout(120)
def test_a_process_past_its_cgroup_limit_is_named_oom_killed(tmp_path):
    """A real process moves into a child memory cgroup (v1) with a 64 MiB limit and allocates past it."""
    base = Path("/sys/fs/cgroup/memory")
    own = memory_cgroup(Path("/proc/self/cgroup").read_text())
    if os.geteuid() != 0 or own is None or own[0] != "v1" or not (base / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    cg = cgroup_dir("v1", own[1]) / f"marind-oom-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    proc = None
    try:
        (cg / "memory.limit_in_bytes").write_text(str(64 << 20))
        code = ("import sys, time; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(__import__('os').getpid()));"
                "time.sleep(1); b = []\nwhile True: b.append(bytearray(8 << 20)); b[-1][::4096] = b'x' * 2048")
        proc = spawn([sys.executable, "-c", code, str(cg)])
        watch = OomWatch()
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            watch.note([proc.pid])                   # as the agent does every tick
            time.sleep(0.1)
        assert proc.wait(5) == -signal.SIGKILL
        ev = watch.evidence(proc.pid)
        assert ev is not None and ev.source == "cgroup" and ev.limit_bytes == 64 << 20 and ev.kills >= 1
        cause = cause_of(node="n1", exitcode=proc.returncode, rank=1, local_rank=1, pid=proc.pid, oom=ev)
        assert cause.kind == "oom_killed" and cg.name in cause.what and "limit 64.0 MiB" in cause.what
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            if proc is not None and int(pid) == proc.pid:       # only the process this test started
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        cg.rmdir()

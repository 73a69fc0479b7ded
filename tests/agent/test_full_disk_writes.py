"""The run dir's writers on a filesystem that is really full (issue 32): a small tmpfs filled with
ballast, a real ENOSPC, nothing mocked.

* a polled JSON file (progress record, ``lease.json``, ``pids.json``) is rewritten on the full
  disk through its spare, and a reader sees each new record whole;
* a worker's progress record and rank 0's history do not raise on it; the history's dropped
  lines leave one unreadable line at most, and the lines after the space came back read;
* torchrun's output relay: a process printing into it never sees an error while the log's disk is
  full; the relay tells the agent once (``full``), drops, writes a marker line and says
  ``resumed`` once space is back, and ends when its last writer is gone.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from marind.agent.output_relay import OutputRelay
from marind.core.history import HistoryTail, HistoryWriter
from marind.core.jsonfile import read_json_object, write_json_atomic
from marind.core.progress import ProgressWriter, read_record, record_path
from marind.testing.small_fs import can_mount, fill, small_tmpfs
from tests.agent.helpers import wait_for

pytestmark = pytest.mark.skipif(can_mount() is not None, reason=can_mount() or "")


def test_a_polled_json_file_is_rewritten_on_a_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "fs", 1) as fs:
        path = fs / "lease.json"
        write_json_atomic(path, {"n": 0})
        assert (fs / ".lease.json.spare").exists()          # made while there is room
        ballast = fill(fs)
        with pytest.raises(OSError) as exc:
            (fs / "other").write_bytes(b"x" * 8192)
        assert exc.value.errno == errno.ENOSPC
        for n in range(1, 50):
            write_json_atomic(path, {"n": n, "pad": "y" * 100})
            assert read_json_object(path) == {"n": n, "pad": "y" * 100}
        with pytest.raises(OSError) as exc:                   # a record that outgrew its spare needs room
            write_json_atomic(path, {"n": -1, "pad": "z" * 10000})
        assert exc.value.errno == errno.ENOSPC
        assert read_json_object(path) == {"n": 49, "pad": "y" * 100}
        ballast.unlink()
        write_json_atomic(path, {"n": -1, "pad": "z" * 10000})
        assert read_json_object(path)["n"] == -1


def test_a_workers_record_and_rank_0s_history_go_on_over_a_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "fs", 1) as fs:
        writer = ProgressWriter(0, 0, 1, fs)
        writer.update(phase="training", step=1)
        writer.update(step=2)                                  # two writes: the spare exists from the first
        history = HistoryWriter(fs / "progress" / "history-rank-0.jsonl")
        tail = HistoryTail(history.path)
        history.append({"step": 1})
        assert [x["step"] for x in tail.read()] == [1]
        ballast = fill(fs)
        for step in range(3, 30):
            writer.update(step=step)                           # no exception: the spare takes it
            history.append({"step": step, "pad": "p" * 200})   # dropped, no exception
        assert read_record(record_path(fs, 0)).step == 29 and writer.dropped == 0
        assert history.dropped > 0
        ballast.unlink()
        history.append({"step": 30})
        history.append({"step": 31})
        steps = [x["step"] for x in tail.read()]              # what fit in the file's last page, then 30, 31
        assert steps[-2:] == [30, 31] and steps == sorted(steps)
        assert len(steps) == 29 - history.dropped            # a line cut short is the only other loss


def test_the_output_relay_drops_on_a_full_disk_and_says_so_once(tmp_path):
    with small_tmpfs(tmp_path / "fs", 1) as fs:
        log = fs / "torchrun.log"
        relay = OutputRelay.start(log)
        try:
            os.write(relay.fd, b"before\n")
            wait_for(lambda: log.exists() and b"before" in log.read_bytes(), 20, "the first line", interval=0.05)
            ballast = fill(fs)
            printer = subprocess.Popen(   # a worker printing to a full log: it must see no error
                [sys.executable, "-c", "import sys\nfor i in range(2000): print('line', i, 'x' * 100)\n"
                                       "sys.stdout.flush(); print('done', file=sys.stderr)"],
                stdout=relay.fd, stderr=subprocess.STDOUT)
            assert printer.wait(60) == 0
            statuses = wait_for(relay.statuses, 20, "the relay's word", interval=0.05)
            assert [s["event"] for s in statuses] == ["full"] and statuses[0]["errno"] == "ENOSPC"
            ballast.unlink()
            os.write(relay.fd, b"after\n")
            resumed = wait_for(relay.statuses, 20, "resumed", interval=0.05)
            assert resumed[0]["event"] == "resumed" and resumed[0]["dropped_bytes"] > 0
            text = wait_for(lambda: b"after" in log.read_bytes() and log.read_text(), 20, "the line after", interval=0.05)
            assert "bytes of output dropped here (ENOSPC" in text
            assert text.index("dropped here") < text.index("after")
        finally:
            relay.handed_over()
        wait_for(relay.done, 20, "the relay's end once its last writer closed the pipe", interval=0.05)
        assert relay.proc.returncode == 0
        relay.close()
        assert relay.statuses() == []


class _Log:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def _add(self, level):
        return lambda event, **kw: self.lines.append((level, event))

    def __getattr__(self, level):
        return self._add(level)


class _Outbox:
    client = None

    def event(self, *a):
        pass

    def last_error(self, *a):
        pass


def test_the_curves_pause_on_a_full_disk_and_go_on_in_a_new_event_file(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import marind.agent.run_history as RH
    from marind.core.history import history_line, history_path
    from marind.core.spec import load_spec

    monkeypatch.setattr(RH, "TB_RETRY_S", 0.0)
    with small_tmpfs(tmp_path / "fs", 1) as fs:          # the curves' disk; the history is elsewhere
        spec = load_spec(f'[job]\ncommand = ["python", "t.py"]\nworking_dir = "/w"\ntensorboard_dir = "{fs}/tb"\n')
        run_dir = tmp_path / "run"
        log = _Log()
        hist = RH.RunHistory("j", spec, run_dir, node="n", outbox=_Outbox(), log=log)
        writer = HistoryWriter(history_path(run_dir))

        def report(step):
            writer.append(history_line(step, loss=1.0 / step, tokens_per_s=10.0, metrics={"m": 1.0}, at=1.0, pid=1))
            hist.poll()

        report(1)
        ballast = fill(fs)
        for step in range(2, 300):                         # the event file's last page fills, then no room
            report(step)
        assert ("warning", "tensorboard_paused") in log.lines and ("warning", "tensorboard_off") not in log.lines
        assert hist._tb is None
        ballast.unlink()
        for step in range(300, 305):
            report(step)
        hist.close()
        assert ("info", "tensorboard_resumed") in log.lines
        files = sorted((fs / "tb").iterdir())
        assert len(files) == 2                             # the first, and the one after the space came back
        acc = EventAccumulator(str(fs / "tb"))
        acc.Reload()
        steps = [e.step for e in acc.Scalars("loss")]
        assert steps[0] == 1 and steps[-5:] == [300, 301, 302, 303, 304] and len(steps) < 304

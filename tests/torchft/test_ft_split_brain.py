"""The power-off of the lighthouse's host, reduced to its torchft core: a suspected cause of the
one-in-six run that ended with one group's parameters different from the others'.

Group B and lighthouse L1 share a host that freezes (SIGSTOP: a power-off). Group A's agent elects
L2 (here: A's lighthouse file is rewritten to L2, epoch 2) and A trains on alone. When the host
comes back, L1 comes back with it and still believes in its old quorum; B's lighthouse file still
names L1 until B's agent has caught up with etcd. Meanwhile L1 has heard no heartbeat from A for
long, so B alone is a valid quorum there: B trains on its own history (split brain), and when it
follows L2 it merges with A by step count alone. If the counts happen to be equal, torchft heals
nobody: the groups hold different parameters for good while every later gradient norm matches
(they average the same gradients). The drift check (``fault.drift_check_every``) is what finds it.

Before the fix, B committed about ten steps alone on the resumed L1 in eight seconds (this
scenario, run once on a loaded 2-core machine). The fix (``marind.trainer.ft.stale_lighthouse``,
and the late-step check of ``marind.trainer.ft.abort.decide_late`` reading the peers' heartbeats):
B's step in flight is not committed, B alone right after standing still waits for its lighthouse
file, and moves to L2 when the file does; it trains nothing alone on L1. Both groups end with the
same parameters.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

pytest.importorskip("torchft")

from marind.agent.ft.coordinator import LighthouseProcess
from marind.core.lighthouse_file import LighthouseRecord, write_lighthouse
from tests.torchft.groups import FAULT, ft_spec, logs, progress, run_dir, signal_group, start_group, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STALE_S = 8.0        # how long B follows the resumed L1 before its agent would point it at L2
STEPS = 400
FREEZE_S = 6.0       # at least this long frozen (a real election waits out a lease TTL)


def _lines(tmp_path, group: int) -> list[dict]:
    text = (tmp_path / f"rg{group}.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_group_resumed_with_its_stale_lighthouse_trains_alone_and_the_groups_end_equal(tmp_path):
    l1 = LighthouseProcess(FAULT, tmp_path / "l1.log", "127.0.0.1")
    l2 = LighthouseProcess(FAULT, tmp_path / "l2.log", "127.0.0.1")
    l1.start()
    try:
        for g in (0, 1):
            run_dir(tmp_path, g).mkdir(parents=True, exist_ok=True)
            write_lighthouse(run_dir(tmp_path, g), LighthouseRecord(l1.address, 1, "host-b"))
        spec = ft_spec(tmp_path, steps=STEPS, fault_extra="drift_check_every = 20")
        start_group(tmp_path, 0, spec)
        b = start_group(tmp_path, 1, spec)
        wait_for(lambda: progress(tmp_path, 0).get("participants") == 2 and progress(tmp_path, 1).get("step", 0) >= 30,
                 300, "both groups stepping together on L1", tmp_path)
        assert l1.proc is not None
        # host B powers off: its group and L1 freeze together
        signal_group(b, signal.SIGSTOP)
        l1.proc.send_signal(signal.SIGSTOP)
        frozen_t = time.monotonic()
        frozen_at = progress(tmp_path, 1).get("step", 0)
        l2.start()
        write_lighthouse(run_dir(tmp_path, 0), LighthouseRecord(l2.address, 2, "host-a"))
        wait_for(lambda: (p := progress(tmp_path, 0)).get("lighthouse_epoch") == 2 and p.get("step", 0) > frozen_at + 20,
                 240, "group A training on L2", tmp_path)
        # host B is back (an election needs the lost lease to expire: the freeze lasts seconds); B's file still names L1
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_t)))
        l1.proc.send_signal(signal.SIGCONT)
        signal_group(b, signal.SIGCONT)
        resumed_at = time.monotonic()
        time.sleep(STALE_S)
        stale_s = time.monotonic() - resumed_at
        alone = [r for r in _lines(tmp_path, 1) if r.get("event") == "step" and r.get("participants") == 1]
        b_then, a_then = progress(tmp_path, 1), progress(tmp_path, 0)
        waited = [r for r in _lines(tmp_path, 1) if r.get("event") == "ft_alone_after_freeze"]
        write_lighthouse(run_dir(tmp_path, 1), LighthouseRecord(l2.address, 2, "host-a"))
        wait_for(lambda: progress(tmp_path, 1).get("lighthouse_epoch") == 2 and progress(tmp_path, 0).get(
            "participants") == 2, 240, "group B merged with A on L2", tmp_path)
        wait_for(lambda: all(progress(tmp_path, g).get("phase") == "done" for g in (0, 1)), 600, "both groups done",
                 tmp_path)
        p0, p1 = progress(tmp_path, 0), progress(tmp_path, 1)
        drift = [r for r in _lines(tmp_path, 1) + _lines(tmp_path, 0) if r.get("event") == "replica_drift"]
        print(f"B after {stale_s:.0f}s on the resumed L1: step {b_then.get('step')} "
              f"(epoch {b_then.get('lighthouse_epoch')}, participants {b_then.get('participants')}), "
              f"A at step {a_then.get('step')}; B's logged solo steps {[r['step'] for r in alone]}; "
              f"drift findings {[(d.get('replica_group'), d['step']) for d in drift]}")
        assert waited, f"B did not wait for its lighthouse file when alone after the freeze\n{logs(tmp_path)}"
        assert b_then.get("step", 0) <= frozen_at + 1, \
            f"B trained alone on the resumed L1 (split brain): {frozen_at} -> {b_then}\n{logs(tmp_path)}"
        assert p0["step"] == p1["step"] == STEPS
        assert p0["param_digest"] == p1["param_digest"], logs(tmp_path)
    finally:
        for lh in (l1, l2):
            if lh.proc is not None:
                try:
                    lh.proc.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
            lh.stop()

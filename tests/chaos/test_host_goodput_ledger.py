"""The goodput ledger of a job that lives through a kill, a hang and a power-off on the multi-host bed.

Three bed hosts run the real trainer (2 ranks each). A rank is SIGKILLed, later a rank is stopped
(SIGSTOP: the job hangs until ``hang_timeout``), then the host running global rank 0 is powered
off (so another agent takes the ledger's bookkeeping over). The job succeeds; its ledger, as
`marind events --json` prints it, has each cause (``detection`` for the kill and the power-off,
``hang``, ``rendezvous`` and ``restart``/``restore`` for the recoveries), its parts add up to
its wall time within a second, and its goodput is the outside figure within 0.01 (the goodput
bench's ``ledger_check``: global rank 0's step lines in every host's torchrun log, each step
number's first run, less the saves that blocked them, over the ledger's wall time). ``slow`` (``make chaos``); CI has the kill (tests/agent/test_job_page.py).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from bench.goodput_common import ledger_check, parse_step_lines
from marind.testing.chaos import host_faults
from tests.agent.helpers import wait_for
from tests.chaos.test_host_scenarios import EVERY, _submit, _training_on_all, bed_cluster, dataset, hostbed

pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.timeout(1800)]
__all__ = ["bed_cluster", "dataset", "hostbed"]      # the fixtures, shared


def _rank_pid(cluster, job: str, rank: int) -> int:
    recs = cluster.client.get_prefix_json(cluster.client.key("jobs", job, "nodes") + "/")
    for rec in recs.values():
        for w in rec.get("workers") or []:
            if isinstance(w, dict) and w.get("rank") == rank:
                return int(w["pid"])
    raise AssertionError(f"no worker of {job} has rank {rank}: {recs}")


def _ledger(cluster, job: str, capsys) -> dict:
    from marind.cli import main as marind_main

    capsys.readouterr()
    assert marind_main(["events", job, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["kind"] == "ledger", last
    return last["detail"]


@pytest.mark.parametrize("hostbed", [("host1", "host2", "host3")], indirect=True)
def test_a_kill_a_hang_and_a_power_off_each_have_their_cause(bed_cluster, capsys):
    cluster = bed_cluster
    steps = 150
    job, _ = _submit(cluster, "ledger", "1:3", steps, hang_timeout="90s")   # steps are slow on a loaded bed
    _training_on_all(cluster, job, EVERY + 2)

    def recovered(after: int, world: int) -> None:
        wait_for(lambda: cluster.world_size(job) == world and cluster.step(job) > after, 300,
                 "the job training again", interval=0.2, diag=cluster.diag)

    at = cluster.step(job)                                          # 1. a rank killed
    os.kill(_rank_pid(cluster, job, 3), signal.SIGKILL)
    wait_for(lambda: cluster.kinds(job, "restart"), 120, "the kill's restart", diag=cluster.diag)
    recovered(at + 2, 6)
    at = cluster.step(job)                                          # 2. a rank stopped: a hang
    os.kill(_rank_pid(cluster, job, 2), signal.SIGSTOP)
    wait_for(lambda: cluster.kinds(job, "hang_detected"), 180, "the hang detected", diag=cluster.diag)
    recovered(at, 6)
    victim = cluster.host_of_rank(job, 0)                           # 3. rank 0's host powered off
    at = cluster.step(job)
    assert cluster.bed.power_off(victim), f"nothing ran in {victim}"
    host_faults.kill_host_processes(cluster.bed.host(victim))
    recovered(at, 4)
    state = cluster.wait_done(job, timeout=900)
    assert state["state"] == "SUCCEEDED", state

    ledger = _ledger(cluster, job, capsys)
    s = ledger["seconds"]
    assert ledger["final"] and abs(sum(s.values()) - ledger["wall_s"]) < 1.0, ledger
    assert s["training"] > 0 and s["detection"] > 0 and s["hang"] >= 10, ledger      # the stall of hang_timeout
    assert s["rendezvous"] > 0 and s["restart"] + s["restore"] > 0, ledger
    assert 0 < ledger["goodput"] < 1
    lines = []
    for node in cluster.nodes:
        log = cluster.tmp / f"state-{node}" / "jobs" / job / "logs" / "torchrun.log"
        lines += parse_step_lines(log.read_text(errors="replace")) if log.exists() else []
    check = ledger_check(ledger, lines)
    print(f"ledger goodput {ledger['goodput']}, outside {check['outside_goodput']}")     # the figure, with -s
    assert abs(check["goodput_minus_outside"]) <= 0.01, (check, ledger)

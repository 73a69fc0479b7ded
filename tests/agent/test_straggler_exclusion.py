"""A node taken out of a job for its straggler (``[fault] straggler_action = "exclude"``), under real agents.

Two real agents run the tiny worker (one rank each, ``nodes = "1:2"``). The test writes node b's
exclusion as the deciding agent would (``marind.control.job_exclusions.exclude``, the jobs marked
changed): b's agent stops its part of the job and says so (``node_left``, ``excluded as a
straggler``), the job goes on with a alone in a new round, and b does not start it again, also
after its agent restarts. The decision that writes the key, from real compute samples, is
``test_stragglers.py``'s (real etcd); with the reference trainer and a slowed rank, end to end:
``bench/straggler_bench.py`` (its ``--quick`` shape: ``make chaos``).
"""

from __future__ import annotations

import time

import pytest

from marind.cli import main
from marind.control.events import list_events
from marind.control.job_exclusions import exclude
from marind.control.job_records import mark_jobs_changed
from marind.testing.cluster import stop_agent
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, tiny_spec, wait_for

pytestmark = pytest.mark.timeout(300)


def _workers_of(client, job: str, node: str) -> list:
    rec = client.get_json(client.key("jobs", job, "nodes", node)) or {}
    return rec.get("workers") or []


def test_an_excluded_node_leaves_the_job_and_stays_out(tmp_path, etcd, etcd_client, etcd_prefix, capsys,
                                                      monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    agents = {n: start_agent(tmp_path, n, etcd.endpoint, etcd_prefix, slots=1) for n in ("a", "b")}
    diag = lambda: "\n".join(f"--- {n} ---\n{agent_log(tmp_path, n)}" for n in agents)
    try:
        wait_for(lambda: all(node_registered(etcd_client, n) for n in agents), 30, "both registered", diag=diag)
        spec = tiny_spec(tmp_path, name="excl", nodes="1:2", nproc=1, steps=100000)
        spec.write_text(spec.read_text() + '\n[fault]\nstraggler_action = "exclude"\n')
        assert main(["submit", str(spec)]) == 0
        job = capsys.readouterr().out.strip().splitlines()[-1]
        progress = lambda: etcd_client.get_json(etcd_client.key("jobs", job, "progress")) or {}
        wait_for(lambda: progress().get("world_size") == 2 and progress().get("step", 0) >= 3, 180,
                 "the job stepping on a and b", diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")

        assert exclude(etcd_client, job, "b", {"reason": "node b taken out of the job (test)"}, by="a")
        mark_jobs_changed(etcd_client)
        left = wait_for(lambda: [e for e in list_events(etcd_client, job) if e["kind"] == "node_left"], 60,
                        "b leaving the job", diag=diag)
        assert [(e["node"], e["detail"]["reason"]) for e in left] == [("b", "excluded as a straggler")], left
        at = progress().get("step", 0)
        wait_for(lambda: progress().get("world_size") == 1 and progress().get("step", 0) > at + 2, 120,
                 "the job stepping on a alone", diag=diag)
        assert not _workers_of(etcd_client, job, "b")
        assert job_state(etcd_client, job)["state"] == "RUNNING"
        assert not [e for e in list_events(etcd_client, job) if e["kind"] == "node_lost"]   # a clean departure

        stop_agent(agents["b"])                 # b's agent restarts: the exclusion still holds
        agents["b"] = start_agent(tmp_path, "b", etcd.endpoint, etcd_prefix, slots=1)
        wait_for(lambda: node_registered(etcd_client, "b"), 30, "b registered again", diag=diag)
        time.sleep(3)                           # a few of its ticks: it reads the jobs at once on start
        assert not [e for e in list_events(etcd_client, job) if e["kind"] in ("node_joined", "node_rejoined")
                    and e["node"] == "b" and e["at"] > left[0]["at"]]
        assert progress().get("world_size") == 1
    finally:
        for proc in agents.values():
            stop_agent(proc)

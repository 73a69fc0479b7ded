"""A node name is unique: a second live agent with the name exits 2 naming the holder; a restarted
agent on the same host whose predecessor is dead takes the name over at once (real agents)."""

from __future__ import annotations

import signal

from marind.testing.procs import kill_group
from tests.agent.helpers import agent_log, node_registered, start_agent, wait_for


def test_one_name_one_agent(tmp_path, etcd, etcd_client, etcd_prefix):
    first = start_agent(tmp_path / "a", "same", etcd.endpoint, etcd_prefix)
    record = wait_for(lambda: node_registered(etcd_client, "same"), 30, "first agent registered",
                      diag=lambda: agent_log(tmp_path / "a", "same"))
    assert record["pid"] == first.pid and record["host"]

    second = start_agent(tmp_path / "b", "same", etcd.endpoint, etcd_prefix)
    assert second.wait(60) == 2
    errors = [line for line in agent_log(tmp_path / "b", "same").splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, agent_log(tmp_path / "b", "same")
    assert f"held by a live agent on host {record['host']}, pid {first.pid}" in errors[0]
    assert node_registered(etcd_client, "same")["pid"] == first.pid     # the holder keeps its record
    assert first.poll() is None

    kill_group(first, signal.SIGKILL)        # its lease lives on for lease_ttl
    first.wait(10)
    third = start_agent(tmp_path / "c", "same", etcd.endpoint, etcd_prefix)
    wait_for(lambda: (node_registered(etcd_client, "same") or {}).get("pid") == third.pid, 30,
             "the restarted agent registered", diag=lambda: agent_log(tmp_path / "c", "same"))
    assert "node_taken_over" in agent_log(tmp_path / "c", "same")
    assert third.poll() is None

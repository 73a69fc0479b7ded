"""End to end on the bed: a real `marind agent` in each of two hosts registers through etcd on the
control network, and a 2-node tiny job trains to SUCCEEDED with its collectives on the data network."""

from __future__ import annotations

import pytest

from marind.cli import main
from marind.core.etcd_client import EtcdClient
from marind.testing.hosts_net import established_tcp
from tests.agent.helpers import agent_log, done_record, job_state, node_registered, tiny_spec, wait_for

pytestmark = pytest.mark.hosts


def _links_between(bed, mine: str, peer: str) -> set[tuple[str, str]]:
    """host1's established TCP connections between the addresses ``mine`` and ``peer``."""
    text = "\n".join(bed.run("host1", ["cat", f], check=True).stdout for f in ("/proc/net/tcp", "/proc/net/tcp6"))
    return {(a, b) for a, b in established_tcp(text) if {a.rsplit(":", 1)[0], b.rsplit(":", 1)[0]} == {mine, peer}}


def test_two_agents_in_two_hosts_train_a_two_node_job(bed, etcd_prefix, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", bed.plan.etcd)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    for name in bed.names:
        bed.start_agent(name, etcd_prefix, env={"MARIND_TEST_STEP_SLEEP": "0.2"})
    diag = lambda: "\n".join(f"--- {n} ---\n{agent_log(bed.root, n)}" for n in bed.names)
    with EtcdClient(bed.plan.etcd, prefix=etcd_prefix) as client:
        # no --node: each agent is named after its host's own hostname
        wait_for(lambda: all(node_registered(client, n) for n in bed.names), 60, "both agents registered",
                 diag=diag)
        assert [node_registered(client, n)["host"] for n in bed.names] == bed.names

        spec = tiny_spec(bed.root, name="bed", nodes="2:2", nproc=1, steps=40, max_restarts=2)
        assert main(["submit", str(spec)]) == 0
        job = capsys.readouterr().out.strip().splitlines()[-1]

        def training_on_two():
            doc = client.get_json(client.key("jobs", job, "progress")) or {}
            return doc.get("world_size") == 2 and doc.get("step", 0) >= 3
        wait_for(training_on_two, 120, "the job training on two hosts",
                 diag=lambda: f"{job_state(client, job)}\n{diag()}")
        # the workers' store and gloo pairs run between the hosts' data addresses, etcd over control
        assert _links_between(bed, bed.addr("host1", "data"), bed.addr("host2", "data"))
        assert _links_between(bed, bed.addr("host1", "control"), bed.plan.server_addrs["control"])
        assert not _links_between(bed, bed.addr("host1", "control"), bed.addr("host2", "control"))
        wait_for(lambda: job_state(client, job).get("state") == "SUCCEEDED", 180, f"{job} SUCCEEDED",
                 diag=lambda: f"{job_state(client, job)}\n{diag()}")
    done = done_record(spec)
    assert done and done["step"] == 40 and done["world_size"] == 2

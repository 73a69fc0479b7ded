"""`marind submit/status/cancel/nodes/rm` against a real etcd, without agents.

Bad input exits 2 with one line on stderr and writes nothing to etcd; an
unreachable etcd exits 3; empty results print a plain sentence.
"""

from __future__ import annotations

import json

import pytest

from marind.cli import main
from marind.core.netutil import free_port
from tests.agent.helpers import tiny_spec

BAD_SPECS = {
    "syntax": "[job\nname = 'x'\n",
    "unknown_key": "[job]\nname = 'x'\nnprocs = 2\n[data]\npath = 'd'\n",
    "wrong_type": "[job]\nname = 'x'\nnproc_per_node = 'two'\n[data]\npath = 'd'\n",
    "impossible_mesh": "[job]\nname = 'x'\nnproc_per_node = 2\n[model]\npreset = 'tiny'\n[parallel]\ntp = 3\n"
                       "[data]\npath = 'd'\n",
}


@pytest.fixture
def cli(capsys, monkeypatch, etcd, etcd_prefix, tmp_path):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("MARIND_DEBUG", raising=False)

    def run(*argv):
        rc = main(list(argv))
        cap = capsys.readouterr()
        return rc, cap.out, cap.err
    return run


@pytest.mark.parametrize("kind", sorted(BAD_SPECS))
def test_bad_spec_exits_2_and_writes_nothing(cli, tmp_path, etcd_client, etcd_prefix, kind):
    path = tmp_path / "run.toml"
    path.write_text(BAD_SPECS[kind])
    rc, out, err = cli("submit", str(path))
    assert rc == 2, err
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert etcd_client.get_prefix(etcd_prefix + "/") == []


@pytest.mark.unit
def test_etcd_down_exits_3(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MARIND_ETCD", f"http://127.0.0.1:{free_port()}")
    spec = tiny_spec(tmp_path)
    for argv in (["submit", str(spec)], ["status"], ["cancel", "nope"]):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert err.startswith("Error: etcd unreachable") and err.count("\n") == 1, err


def test_submit_status_cancel_rm(cli, tmp_path, etcd_client):
    rc, out, err = cli("status")
    assert rc == 0 and "No nodes." in out and "No jobs." in out
    rc, out, err = cli("submit", str(tiny_spec(tmp_path, name="cli")), "--id", "cli-job-1")
    assert rc == 0 and out.strip().splitlines()[-1] == "cli-job-1" and "marind status cli-job-1" in out
    spec = json.loads(etcd_client.get(etcd_client.key("jobs", "cli-job-1", "spec"))[0])
    assert spec["job"]["name"] == "cli"   # the validated spec itself (docs/design.md §2)
    rc, out, err = cli("submit", str(tiny_spec(tmp_path, name="cli")), "--id", "cli-job-1")
    assert rc == 2 and "already exists" in err
    rc, out, err = cli("status", "--json")
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["nodes"] == []
    assert [(j["id"], j["state"]) for j in doc["jobs"]] == [("cli-job-1", "PENDING")]
    rc, out, err = cli("rm", "cli-job-1")
    assert rc == 2 and "cancel" in err
    rc, out, err = cli("cancel", "cli-job-1")
    assert rc == 0
    state = etcd_client.get_json(etcd_client.key("jobs", "cli-job-1", "state"))
    assert state["state"] == "CANCELLED" and "cancelled by" in state["reason"]
    assert etcd_client.get_json(etcd_client.key("jobs", "cli-job-1", "cancel"))["by"]
    rc, out, err = cli("status", "nope")
    assert rc == 1 and err.startswith("Error: no job")
    rc, out, err = cli("rm", "cli-job-1")
    assert rc == 0
    rc, out, err = cli("submit", str(tiny_spec(tmp_path, name="cli")), "--json")
    assert rc == 0 and json.loads(out)["id"].startswith("cli-")
    rc, out, err = cli("logs", "cli-job-1")
    assert rc == 1 and "no logs" in err


def test_status_shows_the_step_a_job_ended_at_when_rank0s_report_lags(cli, tmp_path, etcd_client):
    """The node that ends a job may not hold global rank 0; its final step rides on the state."""
    from marind.control.job_records import update_state
    from marind.control.lifecycle import JobEvent
    cli("submit", str(tiny_spec(tmp_path, name="lag")), "--id", "lag-1")
    etcd_client.put_json(etcd_client.key("jobs", "lag-1", "progress"), {"step": 59, "updated_at": 1.0})
    update_state(etcd_client, "lag-1", JobEvent.WORKERS_STARTED)
    rc, out, _ = cli("status", "lag-1", "--json")
    assert json.loads(out)["jobs"][0]["step"] == 59
    update_state(etcd_client, "lag-1", JobEvent.SUCCEEDED, step=60)
    rc, out, _ = cli("status", "lag-1", "--json")
    row = json.loads(out)["jobs"][0]
    assert (row["state"], row["step"]) == ("SUCCEEDED", 60)
    etcd_client.put_json(etcd_client.key("jobs", "lag-1", "progress"), {"step": 60, "updated_at": 2.0})
    rc, out, _ = cli("status", "lag-1", "--json")
    assert json.loads(out)["jobs"][0]["step"] == 60


def test_submit_nodes_replaces_the_run_tomls_node_range(cli, tmp_path, etcd_client, etcd_prefix):
    """``--nodes`` (a scheduler's allocation, examples/slurm) is stored in place of ``job.nodes``, checked
    like it: a bad range is one line, exit 2, and nothing reaches etcd."""
    spec_path = str(tiny_spec(tmp_path, name="alloc", nodes="1:1"))
    for bad in ("0:2", "3:2", "two", "1:2:3"):
        rc, out, err = cli("submit", spec_path, "--nodes", bad)
        assert rc == 2 and err.startswith("Error: --nodes") and err.count("\n") == 1, (bad, err)
    assert etcd_client.get_prefix(etcd_prefix + "/") == []
    rc, out, err = cli("submit", spec_path, "--nodes", "2:3", "--id", "alloc-1")
    assert rc == 0, err
    spec = json.loads(etcd_client.get(etcd_client.key("jobs", "alloc-1", "spec"))[0])
    assert spec["job"]["nodes"] == "2:3"

"""Who may run code on every node, end to end (docs/design.md §2, "etcd roles" and "signed jobs").

A real etcd with auth on (`marind auth setup --enable`), a real `marind agent` logged in as the
agents' etcd user and requiring signed jobs, and a submitter: the job signed with a trusted key
runs to SUCCEEDED; an unsigned job and one signed with a key the agent does not trust are
refused (FAILED, ``refused: ...``, one ``job_refused`` event each) and nothing of them is
started on the node: no torchrun (the agent's log), no run dir (made before torchrun starts), no
node record, no ``node_joined``. An agent whose trusted key file is missing does not start (exit 2).
"""

from __future__ import annotations

import json

import pytest

from marind.agent.job_trust import JobTrust, refuse
from marind.cli import main
from marind.control.config import load_config
from marind.control.events import JOB_REFUSED, list_events
from marind.control.job_records import create_job
from marind.core.errors import SpecError
from marind.core.etcd_client import EtcdClient
from tests.agent.helpers import agent_log, job_state, start_agent, tiny_spec, wait_for

PASSWORDS = {"root": "root-pw", "alice": "a-pw", "node": "n-pw"}


def _submit(capsys, spec, *extra: str) -> str:
    rc = main(["submit", str(spec), "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)["id"]


def test_only_jobs_signed_by_a_trusted_key_run(etcd_private, tmp_path, monkeypatch, capsys):
    prefix = "/marind-signed"
    for var in ("MARIND_CONFIG", "MARIND_SIGN_KEY", "MARIND_ETCD_USER", "MARIND_ETCD_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MARIND_ETCD", etcd_private.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", prefix)
    pw = tmp_path / "passwords"
    pw.write_text("".join(f"{u}:{p}\n" for u, p in PASSWORDS.items()))
    assert main(["auth", "setup", "--submitter", "alice", "--agent", "node", "--passwords", str(pw), "--enable"]) == 0
    assert main(["keygen", str(tmp_path / "trusted")]) == 0
    assert main(["keygen", str(tmp_path / "other")]) == 0
    capsys.readouterr()

    config = tmp_path / "marind.toml"
    config.write_text(f'[etcd]\nuser = "node"\npassword = "{PASSWORDS["node"]}"\n'
                      f'[agent]\nrequire_signed_jobs = true\ntrusted_keys = ["{tmp_path / "trusted.pub"}"]\n')
    agent = start_agent(tmp_path, "n1", etcd_private.endpoint, prefix, env={"MARIND_CONFIG": str(config)})
    root = EtcdClient(etcd_private.endpoint, prefix=prefix, user="root", password=PASSWORDS["root"])
    try:
        wait_for(lambda: root.get(root.key("nodes", "n1"))[0], 120, "the agent to register as etcd user node",
                 diag=lambda: agent_log(tmp_path, "n1"))
        monkeypatch.setenv("MARIND_ETCD_USER", "alice")
        monkeypatch.setenv("MARIND_ETCD_PASSWORD", PASSWORDS["alice"])
        unsigned = _submit(capsys, tiny_spec(tmp_path, name="unsigned", nodes="1", nproc=1, steps=3))
        wrong = _submit(capsys, tiny_spec(tmp_path, name="wrong", nodes="1", nproc=1, steps=3),
                        "--sign-key", str(tmp_path / "other"))
        signed = _submit(capsys, tiny_spec(tmp_path, name="signed", nodes="1", nproc=1, steps=3),
                         "--sign-key", str(tmp_path / "trusted"))
        assert root.get_json(root.key("jobs", signed, "signature"))["alg"] == "ed25519"
        assert root.get(root.key("jobs", unsigned, "signature"))[0] is None

        wait_for(lambda: job_state(root, signed).get("state") == "SUCCEEDED", 240, "the signed job to succeed",
                 diag=lambda: f"{job_state(root, signed)}\n{agent_log(tmp_path, 'n1')}")
        assert (tmp_path / "state-n1" / "jobs" / signed).is_dir()
        for job, why in ((unsigned, "the job is not signed"), (wrong, "not among this agent's trusted_keys")):
            state = wait_for(lambda j=job: job_state(root, j).get("state") == "FAILED" and job_state(root, j), 120,
                             f"job {job} to be refused", diag=lambda: agent_log(tmp_path, "n1"))
            assert state["reason"].startswith("refused: ") and why in state["reason"], state
            events = list_events(root, job)
            refused = [e for e in events if e["kind"] == JOB_REFUSED]
            assert len(refused) == 1 and why in refused[0]["detail"]["reason"], events
            assert refused[0]["node"] == "n1"
            assert not any(e["kind"] in ("node_joined", "restart") for e in events), events
            assert not (tmp_path / "state-n1" / "jobs" / job).exists()     # no run dir: no torchrun, no worker
            assert root.get_prefix_keys(root.key("jobs", job, "nodes") + "/") == []
        started = [line for line in (tmp_path / "agent-n1.log").read_text(errors="replace").splitlines()
                   if "torchrun_started" in line]
        assert any(f"/jobs/{signed}/" in line for line in started), started
        assert not any(f"/jobs/{j}/" in line for line in started for j in (unsigned, wrong)), started
        rc = main(["status", unsigned])
        assert rc == 0 and "refused" in capsys.readouterr().out
    finally:
        root.close()
        agent.terminate()
        agent.wait(timeout=60)


def test_a_job_is_refused_once_however_many_agents_refuse_it(etcd_client, tmp_path):
    spec = {"job": {"name": "x"}}
    assert create_job(etcd_client, "alice.x-1", spec)
    assert refuse(etcd_client, "alice.x-1", "n1", "the job is not signed", None)
    assert not refuse(etcd_client, "alice.x-1", "n2", "the job is not signed", None)
    state = job_state(etcd_client, "alice.x-1")
    assert state["state"] == "FAILED" and state["reason"] == "refused: the job is not signed"
    events = list_events(etcd_client, "alice.x-1")
    assert [(e["kind"], e["node"]) for e in events] == [(JOB_REFUSED, "n1")]


@pytest.mark.unit
def test_an_agent_whose_trusted_key_is_missing_does_not_start(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[agent]\nrequire_signed_jobs = true\ntrusted_keys = ["{tmp_path / "missing.pub"}"]\n')
    with pytest.raises(SpecError, match="cannot read trusted key .*missing.pub") as info:
        JobTrust.from_config(load_config(str(bad), env={}))      # as Agent.__init__ does
    assert info.value.exit_code == 2
    (tmp_path / "none.toml").write_text("[agent]\nrequire_signed_jobs = true\n")
    with pytest.raises(SpecError, match="trusted_keys lists no key"):
        load_config(str(tmp_path / "none.toml"), env={})

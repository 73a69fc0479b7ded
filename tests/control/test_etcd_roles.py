"""etcd roles for marind (docs/design.md §2, "etcd roles"): the plan, and the roles at work on a
real etcd with auth on, through the real CLI (`marind auth setup`, submit, status, events, cancel)."""

from __future__ import annotations

import json

import pytest

from marind.cli import main
from marind.control import auth_roles as A
from marind.core.errors import PermissionDenied
from marind.core.etcd_client import EtcdClient
from tests.agent.helpers import tiny_spec

PASSWORDS = {"root": "root-pw", "vera": "v-pw", "alice": "a-pw", "bob": "b-pw", "node": "n-pw"}


@pytest.mark.unit
def test_the_plan_gives_each_submitter_its_own_prefix_and_the_viewer_no_write():
    p = A.plan("/m", viewers=["vera"], submitters=["alice", "bob"], agents=["node"])
    by_role: dict[str, set] = {}
    for g in p.grants:
        by_role.setdefault(g.role, set()).add((g.perm, g.key, g.prefix))
    assert by_role[A.VIEWER] == {("read", "/m/jobs/", True), ("read", "/m/nodes/", True),
                                 ("read", "/m/jobs_changed", False)}
    assert by_role["marind-submitter-alice"] == {("readwrite", "/m/jobs/alice.", True)}
    assert by_role["marind-submitter-bob"] == {("readwrite", "/m/jobs/bob.", True)}
    assert all(perm == "read" or key == "/m/jobs_changed" for perm, key, _ in by_role[A.SUBMITTER])
    assert by_role[A.AGENT] == {("readwrite", "/m/", True)}
    assert dict(p.users) == {"vera": (A.VIEWER,), "alice": (A.SUBMITTER, "marind-submitter-alice"),
                             "bob": (A.SUBMITTER, "marind-submitter-bob"), "node": (A.AGENT,)}
    cmds = A.etcdctl_commands(p, enable=True)
    assert "etcdctl role grant-permission marind-submitter-alice --prefix=true readwrite /m/jobs/alice." in cmds
    assert cmds[-1] == "etcdctl auth enable"


@pytest.mark.unit
def test_auth_roles_prints_the_etcdctl_commands(capsys):
    assert main(["auth", "roles", "--prefix", "/m", "--submitter", "alice", "--viewer", "vera"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "etcdctl role grant-permission marind-viewer --prefix=true read /m/jobs/" in out
    assert "etcdctl user grant-role alice marind-submitter-alice" in out
    assert not any("auth enable" in line for line in out)
    assert main(["auth", "roles", "--submitter", "a.b"]) == 2
    assert "no '.'" in capsys.readouterr().err


@pytest.mark.unit
def test_user_names_and_owned_ids():
    with pytest.raises(ValueError, match="no '.'"):
        A.plan("/m", submitters=["a.b"])
    with pytest.raises(ValueError, match="more than one kind"):
        A.plan("/m", viewers=["x"], agents=["x"])
    assert A.owned_job_id("alice", "t-1") == "alice.t-1"
    assert A.owned_job_id("alice", "alice.t-1") == "alice.t-1"
    assert A.owned_job_id(None, "t-1") == "t-1"


def _as(monkeypatch, user: str | None) -> None:
    if user is None:
        monkeypatch.delenv("MARIND_ETCD_USER", raising=False)
        monkeypatch.delenv("MARIND_ETCD_PASSWORD", raising=False)
    else:
        monkeypatch.setenv("MARIND_ETCD_USER", user)
        monkeypatch.setenv("MARIND_ETCD_PASSWORD", PASSWORDS[user])


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_viewer_submitter_and_agent_roles_on_a_real_etcd_with_auth(etcd_private, tmp_path, monkeypatch, capsys):
    prefix = "/marind-roles"
    monkeypatch.setenv("MARIND_ETCD", etcd_private.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", prefix)
    monkeypatch.delenv("MARIND_CONFIG", raising=False)
    pw = tmp_path / "passwords"
    pw.write_text("".join(f"{u}:{p}\n" for u, p in PASSWORDS.items()))
    users = ["--viewer", "vera", "--submitter", "alice", "--submitter", "bob", "--agent", "node"]
    _as(monkeypatch, None)
    rc, out, err = _run(capsys, "auth", "setup", *users, "--passwords", str(pw), "--enable")
    assert rc == 0, err
    assert "alice: marind-submitter, marind-submitter-alice" in out
    _as(monkeypatch, None)                        # auth is on: nobody without a user
    rc, _, err = _run(capsys, "status")
    assert rc == 5 and "refused user (none)" in err, err
    _as(monkeypatch, "root")                      # again, as root: nothing changes, no error
    assert _run(capsys, "auth", "setup", *users, "--passwords", str(pw))[0] == 0

    spec = tiny_spec(tmp_path, name="r")
    _as(monkeypatch, "alice")
    rc, out, err = _run(capsys, "submit", str(spec), "--json")
    assert rc == 0, err
    mine = json.loads(out)["id"]
    assert mine.startswith("alice.r-")
    _as(monkeypatch, "bob")
    rc, out, err = _run(capsys, "submit", str(spec), "--json")
    assert rc == 0, err
    bobs = json.loads(out)["id"]

    # the viewer: status and events, and no submit (one line, exit 5)
    _as(monkeypatch, "vera")
    rc, out, err = _run(capsys, "status", "--json")
    assert rc == 0, err
    assert {j["id"] for j in json.loads(out)["jobs"]} == {mine, bobs}
    assert _run(capsys, "events", mine)[0] == 0
    rc, out, err = _run(capsys, "submit", str(spec))
    assert rc == 5, (out, err)
    assert err.startswith("Error: etcd user vera may not create job vera.r-") and err.count("\n") == 1, err
    assert _run(capsys, "cancel", mine)[0] == 5

    # a submitter: cancels its own job, not bob's; writes no node record, no other user's key
    _as(monkeypatch, "alice")
    rc, out, err = _run(capsys, "cancel", bobs)
    assert rc == 5 and f"may not cancel job {bobs}" in err and err.count("\n") == 1, err
    rc, out, err = _run(capsys, "cancel", mine)
    assert rc == 0, err
    with EtcdClient(etcd_private.endpoint, prefix=prefix, user="alice", password=PASSWORDS["alice"]) as alice:
        assert json.loads(alice.get(alice.key("jobs", mine, "state"))[0])["state"] == "CANCELLED"
        assert json.loads(alice.get(alice.key("jobs", bobs, "state"))[0])["state"] == "PENDING"
        for key in (alice.key("nodes", "n1"), alice.key("jobs", bobs, "cancel"), alice.key("jobs", bobs, "state"),
                    alice.key("jobs", "unowned", "spec"), alice.key("doctor", "requests", "x")):
            with pytest.raises(PermissionDenied):
                alice.put(key, "{}")
        with pytest.raises(PermissionDenied):
            alice.delete_prefix(alice.key("jobs", bobs) + "/")
    rc, _, err = _run(capsys, "rm", bobs, "--force")
    assert rc == 5, err

    # the agent's role: node records and every job's keys
    with EtcdClient(etcd_private.endpoint, prefix=prefix, user="node", password=PASSWORDS["node"]) as node:
        node.put(node.key("nodes", "n1"), "{}")
        node.put(node.key("jobs", bobs, "nodes", "n1"), "{}")
    with EtcdClient(etcd_private.endpoint, prefix="/elsewhere", user="node", password=PASSWORDS["node"]) as node:
        with pytest.raises(PermissionDenied):
            node.put(node.key("x"), "1")

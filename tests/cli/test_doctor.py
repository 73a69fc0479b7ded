"""`marind doctor` against a real etcd and a real S3 server."""

from __future__ import annotations

import json

import pytest

from marind.cli import main
from marind.commands.doctor import check_etcd, check_store
from marind.core.netutil import free_port


def test_doctor_passes_on_a_good_node(etcd, etcd_prefix, s3, s3_url, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    rc = main(["doctor", "--json", "--etcd", etcd.endpoint, "--ckpt", s3_url,
               "--storage-options", json.dumps(s3.storage_options), "--state-dir", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in doc["checks"]]
    member = f"etcd member {etcd.endpoint}"            # one row per endpoint given: a single member leads
    assert names == ["torch", "cuda", "backends", "all-reduce", "etcd", member, "agent state dirs", "checkpoint store",
                     "etcd binary", "free disk"]
    by_name = {c["name"]: c for c in doc["checks"]}
    for name in ("torch", "backends", "all-reduce", "etcd", member, "agent state dirs", "checkpoint store"):
        assert by_name[name]["ok"], by_name[name]
    assert by_name[member]["detail"].startswith("leader,") and not by_name[member]["warn"]
    assert rc == (0 if doc["ok"] else 1)


@pytest.mark.unit
def test_doctor_names_the_fix_for_failures(tmp_path):
    bad = check_etcd(f"http://127.0.0.1:{free_port()}", None)
    assert not bad.ok and "unreachable" in bad.detail and bad.fix
    (tmp_path / "ro").mkdir(mode=0o500)
    good = check_store(f"file://{tmp_path}/store")
    assert good.ok
    missing = check_store("nosuchproto://x/y")
    assert not missing.ok and missing.fix

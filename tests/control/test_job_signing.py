"""Signed job specs: the canonical form, signing and verification, key files (pure; no etcd)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from marind.control import job_signing as S
from marind.core.errors import SpecError

SPEC = {"job": {"name": "t", "nproc_per_node": 2, "env": {"B": "2", "A": "1"}}, "train": {"steps": 10, "lr": 3e-4},
        "note": "é ünïcode", "flags": [True, None, 1.5]}


def _trusted(*keys):
    return {S.key_id(k.public_key()): k.public_key() for k in keys}


@pytest.mark.unit
def test_canonical_json_is_key_order_free_and_survives_a_store_round_trip():
    shuffled = json.loads(json.dumps({"train": SPEC["train"], "note": SPEC["note"], "flags": SPEC["flags"],
                                      "job": {"env": {"A": "1", "B": "2"}, "nproc_per_node": 2, "name": "t"}}))
    assert S.canonical_json(shuffled) == S.canonical_json(SPEC)
    stored = json.dumps(SPEC, sort_keys=True)          # what create_job writes
    assert S.canonical_json(json.loads(stored)) == S.canonical_json(SPEC)
    assert b" " not in S.canonical_json({"a": [1, 2]})
    with pytest.raises(ValueError):
        S.canonical_json({"x": float("nan")})


@pytest.mark.unit
def test_a_signed_spec_verifies_with_the_key_that_signed_it():
    key = Ed25519PrivateKey.generate()
    record = S.sign("alice.t-1", SPEC, key)
    assert record["alg"] == "ed25519" and record["key_id"] == S.key_id(key.public_key())
    ok, kid = S.verify("alice.t-1", json.loads(json.dumps(SPEC)), record, _trusted(key))
    assert ok and kid == record["key_id"]


@pytest.mark.unit
@pytest.mark.parametrize("case, expect", [
    ("unsigned", "not signed"),
    ("untrusted key", "not among this agent's trusted_keys"),
    ("spec changed", "does not match its stored spec"),
    ("other job id", "does not match its stored spec"),
    ("bad base64", "does not match its stored spec"),
    ("other alg", "not ed25519"),
    ("malformed", "malformed"),
])
def test_every_bad_signature_is_refused_with_its_reason(case, expect):
    good, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    job, spec, trusted = "alice.t-1", dict(SPEC), _trusted(good)
    record = S.sign(job, SPEC, good)
    if case == "unsigned":
        record = None
    elif case == "untrusted key":
        record = S.sign(job, SPEC, other)
    elif case == "spec changed":
        spec = dict(SPEC, train={"steps": 11, "lr": 3e-4})
    elif case == "other job id":
        job = "alice.t-2"
    elif case == "bad base64":
        record = dict(record, signature="!!not base64!!")
    elif case == "other alg":
        record = dict(record, alg="rsa")
    elif case == "malformed":
        record = ["not", "a", "record"]
    ok, why = S.verify(job, spec, record, trusted)
    assert not ok and expect in why, why
    assert "\n" not in why


@pytest.mark.unit
def test_a_signature_of_another_key_under_a_trusted_key_id_is_refused():
    good, forger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    record = dict(S.sign("j", SPEC, forger), key_id=S.key_id(good.public_key()))
    ok, why = S.verify("j", SPEC, record, _trusted(good))
    assert not ok and "does not match" in why


@pytest.mark.unit
def test_keygen_writes_a_pair_that_loads_and_never_overwrites(tmp_path):
    private, public = S.keygen(tmp_path / "k")
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    assert public.read_text().startswith("ssh-ed25519 ")
    key, pub = S.load_private_key(private), S.load_public_key(public)
    assert S.key_id(key.public_key()) == S.key_id(pub)
    assert list(S.load_trusted([str(public)])) == [S.key_id(pub)]
    before = private.read_bytes()
    with pytest.raises(SpecError, match="exists"):
        S.keygen(tmp_path / "k")
    assert private.read_bytes() == before


@pytest.mark.skipif(not (shutil.which("ssh-keygen") and shutil.which("openssl")), reason="needs ssh-keygen and openssl")
def test_keys_made_by_ssh_keygen_and_openssl_load(tmp_path):
    ssh = tmp_path / "ssh"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh)], check=True, timeout=30)
    assert S.key_id(S.load_private_key(ssh).public_key()) == S.key_id(S.load_public_key(f"{ssh}.pub"))
    pem = tmp_path / "ossl.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(pem)], check=True, timeout=30)
    subprocess.run(["openssl", "pkey", "-in", str(pem), "-pubout", "-out", f"{pem}.pub"], check=True, timeout=30)
    assert S.key_id(S.load_private_key(pem).public_key()) == S.key_id(S.load_public_key(f"{pem}.pub"))


@pytest.mark.unit
def test_bad_key_files_are_one_line_errors_naming_the_file(tmp_path):
    (tmp_path / "junk").write_text("hello\n")
    with pytest.raises(SpecError, match="junk is not an unencrypted Ed25519 private key"):
        S.load_private_key(tmp_path / "junk")
    with pytest.raises(SpecError, match="junk is not an Ed25519 public key"):
        S.load_public_key(tmp_path / "junk")
    with pytest.raises(SpecError, match="cannot read trusted key .*missing.pub"):
        S.load_public_key(tmp_path / "missing.pub")

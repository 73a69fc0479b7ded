"""Signed job specs: what `marind submit --sign-key` writes and what an agent checks (docs/design.md §2).

A job is a command every agent runs, so an agent may be told to run only what a key it trusts
signed (``[agent] require_signed_jobs``, ``trusted_keys``). The CLI signs, with an Ed25519
private key, the canonical JSON (keys sorted, no spaces, UTF-8) of ``{"job": id, "spec": spec}``
(the stored spec document, ``RunSpec.to_dict()``), prefixed with ``marind-job-v1`` and a
newline, and writes ``{p}/jobs/{job}/signature`` = ``{alg, key_id, signature}`` in the same
transaction as the spec. The job id is signed too, so a signed spec copied under another id
does not verify. An agent reads the stored spec back, builds the same bytes and verifies.

Keys: ``marind keygen PATH`` (PATH: PKCS#8 PEM private key, mode 0600; PATH.pub: OpenSSH
public key), or ``ssh-keygen -t ed25519`` / ``openssl genpkey -algorithm ed25519``: private
keys in PEM or OpenSSH form, public keys as an OpenSSH line or a PEM SubjectPublicKeyInfo.
``key_id`` is the first 16 hex digits of the SHA-256 of the raw 32-byte public key.

Everything here but the file readers and ``keygen`` is pure.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from marind.core.errors import SpecError

ALG = "ed25519"
DOMAIN = b"marind-job-v1\n"


def canonical_json(value: Any) -> bytes:
    """The one byte form of a JSON value that is signed: keys sorted, no spaces, UTF-8, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def signed_bytes(job: str, spec: Mapping[str, Any]) -> bytes:
    """What is signed for job ``job`` with the stored spec ``spec``."""
    return DOMAIN + canonical_json({"job": job, "spec": spec})


def key_id(public_key: Ed25519PublicKey) -> str:
    """The short name of a public key (16 hex digits of the SHA-256 of its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(job: str, spec: Mapping[str, Any], private_key: Ed25519PrivateKey) -> dict:
    """The signature record stored beside the spec: ``{alg, key_id, signature}`` (base64)."""
    sig = private_key.sign(signed_bytes(job, spec))
    return {"alg": ALG, "key_id": key_id(private_key.public_key()),
            "signature": base64.b64encode(sig).decode("ascii")}


def verify(job: str, spec: Any, record: Any, trusted: Mapping[str, Ed25519PublicKey]) -> tuple[bool, str]:
    """Is the stored spec of ``job`` signed by a trusted key?

    Args:
        job: the job's id.
        spec: the stored spec document (parsed JSON).
        record: the stored signature record (parsed JSON), or None when there is none.
        trusted: the trusted public keys by ``key_id``.

    Returns:
        (True, the key id), or (False, why not: one line naming the problem and the fix).
    """
    if record is None:
        return False, ("the job is not signed and this agent runs only signed jobs "
                       "(agent.require_signed_jobs): submit it with `marind submit --sign-key KEY`")
    if not isinstance(record, dict) or not isinstance(record.get("signature"), str):
        return False, "the job's signature record is malformed (expected {alg, key_id, signature}): submit it again"
    if record.get("alg") != ALG:
        return False, f"the job is signed with {record.get('alg')!r}, not {ALG}: submit it again with an Ed25519 key"
    kid = str(record.get("key_id", ""))
    public_key = trusted.get(kid)
    if public_key is None:
        return False, (f"the job is signed by key {kid}, which is not among this agent's trusted_keys: "
                       "sign with a trusted key, or add its public key to [agent] trusted_keys")
    try:
        sig = base64.b64decode(record["signature"], validate=True)
        public_key.verify(sig, signed_bytes(job, spec))
    except (InvalidSignature, binascii.Error, TypeError, ValueError):
        return False, (f"the job's signature by key {kid} does not match its stored spec (changed after "
                       "signing, or signed for another job id): submit it again, signed")
    return True, kid


# -- keys in files ------------------------------------------------------------------------------

def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read {what} {path}: {exc.strerror or exc}; "
                        "make one with `marind keygen PATH`") from exc


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM (PKCS#8) or OpenSSH file; ``SpecError`` naming the file otherwise."""
    data = _read(path, "signing key")
    key: Any = None
    for loader in (serialization.load_pem_private_key, serialization.load_ssh_private_key):
        try:
            key = loader(data, password=None)
            break
        except (ValueError, TypeError):
            continue
    if not isinstance(key, Ed25519PrivateKey):
        raise SpecError(f"{path} is not an unencrypted Ed25519 private key (PEM or OpenSSH): make one with "
                        "`marind keygen PATH` or `ssh-keygen -t ed25519 -N '' -f PATH`")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """An Ed25519 public key from an OpenSSH line (``ssh-ed25519 AAAA...``) or a PEM file."""
    data = _read(path, "trusted key")
    key: Any = None
    try:
        key = (serialization.load_ssh_public_key(data.strip()) if data.lstrip().startswith(b"ssh-")
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError, binascii.Error):
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise SpecError(f"{path} is not an Ed25519 public key (an OpenSSH `ssh-ed25519 ...` line or PEM): "
                        "use the .pub file `marind keygen` wrote")
    return key


def load_trusted(paths: list[str] | tuple[str, ...]) -> dict[str, Ed25519PublicKey]:
    """The trusted public keys, by ``key_id``."""
    keys = [load_public_key(p) for p in paths]
    return {key_id(k): k for k in keys}


def keygen(path: str | Path, comment: str = "marind") -> tuple[Path, Path]:
    """Write a new Ed25519 key pair: ``path`` (PKCS#8 PEM, mode 0600) and ``path.pub`` (OpenSSH).

    Raises:
        SpecError: either file exists (nothing is written).
    """
    private_path = Path(path).expanduser()
    public_path = private_path.with_name(private_path.name + ".pub")
    for p in (private_path, public_path):
        if p.exists():
            raise SpecError(f"{p} exists: pick another path (a key is never overwritten)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public_path.write_bytes(pub + f" {comment}\n".encode())
    return private_path, public_path

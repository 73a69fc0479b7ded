"""etcd user/password auth and TLS for the etcd3 rendezvous, against real etcd servers."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from marind.core.netutil import free_ports, port_open
from marind.rendezvous import create_etcd3_handler
from marind.testing.procs import spawn


def _ctl(endpoint: str, *args: str, user: str | None = None, **kwargs) -> str:
    cmd = ["etcdctl", f"--endpoints={endpoint}", *(["--user", user] if user else []), *args]
    env = {**os.environ, "ETCDCTL_API": "3"}
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                          timeout=20, **kwargs).stdout


def _params(endpoint: str, **conf) -> RendezvousParameters:
    return RendezvousParameters("etcd3", endpoint, "auth-job", 1, 1, read_timeout="3", **conf)


@pytest.fixture
def etcd_with_auth(etcd_private):
    if shutil.which("etcdctl") is None:
        pytest.skip("etcdctl not installed (Debian package etcd-client)")
    ep = etcd_private.endpoint
    _ctl(ep, "user", "add", "root:root-pw")
    _ctl(ep, "role", "add", "root")
    _ctl(ep, "user", "grant-role", "root", "root")
    _ctl(ep, "user", "add", "trainer:s3cret")
    _ctl(ep, "role", "add", "marind")
    _ctl(ep, "role", "grant-permission", "marind", "--prefix=true", "readwrite", "/marind/")
    _ctl(ep, "user", "grant-role", "trainer", "marind")
    _ctl(ep, "auth", "enable")
    return etcd_private


def test_rendezvous_with_user_and_password(etcd_with_auth):
    endpoint = f"127.0.0.1:{etcd_with_auth.client_port}"
    handler = create_etcd3_handler(_params(endpoint, user="trainer", password="s3cret",
                                           last_call_timeout="1"))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()
    stored = _ctl(etcd_with_auth.endpoint, "get", "--prefix", "--keys-only", "/marind/jobs/auth-job/",
                  user="root:root-pw")
    assert "/marind/jobs/auth-job/rdzv/rounds/0/closed" in stored      # the round's keys, written with auth
    assert "/marind/jobs/auth-job/rdzv/closed" in stored


def test_credentials_from_the_environment(etcd_with_auth, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD_USER", "trainer")
    monkeypatch.setenv("MARIND_ETCD_PASSWORD", "s3cret")
    handler = create_etcd3_handler(_params(f"127.0.0.1:{etcd_with_auth.client_port}"))
    handler.shutdown()


@pytest.mark.parametrize("conf, message", [
    ({"user": "trainer", "password": "wrong"}, "rejected user 'trainer'"),
    ({}, "user name is empty"),
])
def test_bad_or_missing_credentials_are_clear_errors(etcd_with_auth, conf, message, monkeypatch):
    monkeypatch.delenv("MARIND_ETCD_USER", raising=False)
    monkeypatch.delenv("MARIND_ETCD_PASSWORD", raising=False)
    endpoint = f"127.0.0.1:{etcd_with_auth.client_port}"
    with pytest.raises(RendezvousConnectionError, match=message) as info:
        create_etcd3_handler(_params(endpoint, **conf))
    assert endpoint in str(info.value)


def test_user_without_access_to_the_prefix(etcd_with_auth):
    endpoint = f"127.0.0.1:{etcd_with_auth.client_port}"
    with pytest.raises(RendezvousConnectionError, match="permission denied"):
        create_etcd3_handler(_params(endpoint, user="trainer", password="s3cret", prefix="/other"))


# -- TLS --------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(root: Path) -> dict:
    """A CA, a server cert for 127.0.0.1 and a client cert, all with openssl."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=marind-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=root)
    (root / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                  "extendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=root)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.pem", cwd=root)
    return {n: str(root / f) for n, f in [("ca", "ca.pem"), ("server_cert", "server.pem"),
                                          ("server_key", "server.key"), ("client_cert", "client.pem"),
                                          ("client_key", "client.key")]}


@pytest.fixture
def etcd_tls(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: cannot make test certificates")
    certs = _make_certs(tmp_path)
    client_port, peer_port = free_ports(2)
    url = f"https://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log = open(tmp_path / "etcd.log", "wb")
    proc = spawn(["etcd", "--name", "tls", "--data-dir", str(tmp_path / "data"),
                  "--listen-client-urls", url, "--advertise-client-urls", url,
                  "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                  "--initial-cluster", f"tls={peer}", "--log-level", "warn",
                  "--cert-file", certs["server_cert"], "--key-file", certs["server_key"],
                  "--trusted-ca-file", certs["ca"], "--client-cert-auth"],
                 stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 20
    while not port_open("127.0.0.1", client_port) and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "etcd.log").read_text()
        time.sleep(0.1)
    return url, certs


def test_rendezvous_over_tls_with_a_client_certificate(etcd_tls):
    url, certs = etcd_tls
    handler = create_etcd3_handler(_params(url, cacert=certs["ca"], cert=certs["client_cert"],
                                           key=certs["client_key"], last_call_timeout="1"))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()


def test_tls_without_a_client_certificate_is_refused(etcd_tls):
    url, certs = etcd_tls
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1"):
        create_etcd3_handler(_params(url, cacert=certs["ca"]))

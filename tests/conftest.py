"""Shared fixtures: real etcd and S3 servers on 127.0.0.1, and process cleanup.

* ``etcd`` / ``s3`` are session-wide servers; each test gets its own key
  prefix / bucket path (``etcd_prefix``, ``s3_url``) so tests don't see
  each other's data.
* ``etcd_private`` / ``s3_private`` are servers of the test's own, for
  tests that stop, kill or restart them.
* Every child started through ``marind.testing.procs.spawn`` is killed
  after each test, pass or fail.
"""

from __future__ import annotations

import os
import uuid

import pytest

from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_client import EtcdClient
from marind.testing import procs
from marind.testing.s3_server import SeaweedS3


def pytest_collection_modifyitems(config, items):
    """`slow` tests (full chaos scenarios, big layouts) run only with MARIND_FULL=1."""
    if os.environ.get("MARIND_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="long scenario: run with MARIND_FULL=1 (make chaos / make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kill_spawned_processes():
    yield
    procs.kill_all()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    server = LocalEtcd(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_private(tmp_path):
    server = LocalEtcd(tmp_path / "etcd-data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    return f"/marind-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def etcd_client(etcd, etcd_prefix):
    client = EtcdClient(etcd.endpoint, prefix=etcd_prefix)
    yield client
    try:
        client.delete_prefix(etcd_prefix)
    finally:
        client.close()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_private(tmp_path):
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3) -> str:
    return s3.url(f"test-{uuid.uuid4().hex[:10]}")

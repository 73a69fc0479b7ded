"""Fixtures of the multi-host bed tests: a bed of real namespaces, and probes run inside its hosts.

The one skip of the bed: where ``bed_unavailable()`` gives a reason (not
root, no iproute2/util-linux, namespaces forbidden) the bed tests skip
with that line; the tests of its filters also where ``nft_unavailable()``
does. Every bed is torn down after its test, pass or fail (``built_bed``), and
the test fails if anything of it is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from marind.testing.hosts import HostBed, bed_unavailable, nft_unavailable

PORT = 7411


def require_bed() -> None:
    """Skip the calling test, with the reason, where no bed can be built."""
    reason = bed_unavailable()
    if reason:
        pytest.skip(reason)


def require_nft() -> None:
    """Skip the calling test, with the reason, where no bed can be built or its filters (``nft``)
    cannot be used (``HostBed.drop_one_way``/``lossy``)."""
    require_bed()
    reason = nft_unavailable()
    if reason:
        pytest.skip(reason)


def built_bed(tmp_path, names: list[str], **kw) -> Iterator[HostBed]:
    """A bed of ``names`` under ``tmp_path`` for a fixture to yield (``HostBed``'s keywords), torn down
    after the test, pass or fail; the teardown fails if anything of it is left."""
    hb = HostBed(tmp_path / "bed", names, **kw).start()
    try:
        yield hb
    finally:
        hb.close()
    assert hb.leftovers() == []


@pytest.fixture
def bed(tmp_path):
    require_bed()
    yield from built_bed(tmp_path, ["host1", "host2"])


def serve(hb: HostBed, host: str, port: int = PORT) -> subprocess.Popen:
    """The echo server in ``host``, once it accepts on its own addresses."""
    proc = hb.popen(host, [sys.executable, "-m", "tests.hosts.netprobe", "serve", str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if probe(hb, host, hb.addr(host, "control"), port, timeout=1)["connect"] == "ok":
            return proc
        time.sleep(0.1)
    raise AssertionError(f"echo server in {host} not up")


def probe(hb: HostBed, host: str, addr: str, port: int = PORT, timeout: float = 5.0,
          wait_file: str | None = None) -> dict:
    """Run the probe in ``host`` against ``addr``; its JSON result."""
    cmd = [sys.executable, "-m", "tests.hosts.netprobe", "probe", addr, str(port), "--timeout", str(timeout)]
    if wait_file:
        cmd += ["--wait-file", wait_file]
    res = hb.run(host, cmd, timeout=90)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def state_of(pid: int) -> str:
    """A process's state letter from /proc (``T`` stopped, ``S``/``R`` running, ``-`` gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "-"

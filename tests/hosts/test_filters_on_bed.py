"""The bed's half-working links, on real namespaces: one-way drops and loss act as they say, heal, and go.

One-way traffic (UDP datagrams, counted at the receiver) tells the directions of a one-way
drop apart; TCP cannot (half of its handshake is gone either way). Loss is measured over a
fixed number of datagrams with coarse bounds (no timing). Skips where no bed can be built or
``nft`` is missing, with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from marind.testing import hosts_filter
from marind.testing.hosts import HostBed
from tests.hosts.conftest import built_bed, probe, require_nft, serve

pytestmark = pytest.mark.hosts

UDP_PORT = 7412
COUNT = 400


@pytest.fixture
def fbed(tmp_path):
    require_nft()
    yield from built_bed(tmp_path, ["host1", "host2", "host3"], etcd=False)


def udp(hb: HostBed, src: str, dst: str, which: str = "data", count: int = COUNT) -> int:
    """How many of ``count`` datagrams from ``src`` reach ``dst``'s address on ``which``."""
    stop = hb.root / f"udp-stop-{uuid.uuid4().hex[:8]}"
    sink = hb.popen(dst, [sys.executable, "-m", "tests.hosts.netprobe", "udp-sink", str(UDP_PORT),
                          "--stop-file", str(stop)], stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None
        assert json.loads(sink.stdout.readline())["ready"]
        sent = hb.run(src, [sys.executable, "-m", "tests.hosts.netprobe", "udp-send", hb.addr(dst, which),
                            str(UDP_PORT), str(count)], timeout=60)
        assert sent.returncode == 0, sent.stderr
        time.sleep(0.3)                 # the last datagrams' way through the bridge
        stop.touch()
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return json.loads(out.strip().splitlines()[-1])["received"]


def tables(hb: HostBed) -> dict[str, str]:
    return {n: hosts_filter.list_table(hb.host(n).netns) for n in hb.names}


def test_one_way_drop_loses_one_direction_only_and_heals(fbed):
    for name in ("host1", "host2"):
        serve(fbed, name)
    assert fbed.drop_one_way("host1", "host2", "data") == ["host2"]
    assert udp(fbed, "host1", "host2") == 0                       # host1 -> host2 vanishes
    assert udp(fbed, "host2", "host1") == COUNT                   # host2 -> host1 arrives
    assert udp(fbed, "host1", "host3") == COUNT                   # nobody else is touched
    assert udp(fbed, "host1", "host2", "control") == COUNT        # nor the other network
    # TCP needs both directions: a connect either way fails, silently (no reset, no error)
    assert probe(fbed, "host1", fbed.addr("host2", "data"), timeout=2)["connect"] == "timeout"
    assert probe(fbed, "host2", fbed.addr("host1", "data"), timeout=2)["connect"] == "timeout"
    assert probe(fbed, "host1", fbed.addr("host2", "control"), timeout=5)["echo"] == "ok"
    t = tables(fbed)
    assert "one-way host1->host2 data" in t["host2"] and t["host1"] == "" and t["host3"] == ""
    # the reverse direction is a call of its own
    fbed.drop_one_way("host2", "host1", "data")
    assert udp(fbed, "host2", "host1") == 0
    assert fbed.heal("host1") == ["one-way:host1>host2:data", "one-way:host2>host1:data"]
    assert tables(fbed) == {n: "" for n in fbed.names}
    assert udp(fbed, "host1", "host2") == COUNT and udp(fbed, "host2", "host1") == COUNT
    assert probe(fbed, "host2", fbed.addr("host1", "data"), timeout=5)["echo"] == "ok"


def test_a_lossy_link_loses_about_its_share_each_way(fbed):
    serve(fbed, "host1")
    fbed.lossy("host1", "data", 25)
    # 400 datagrams at 25 %: 300 expected, sd ~9; the bounds are ~6 sd wide
    for src, dst in (("host1", "host2"), ("host2", "host1"), ("host3", "host1")):
        got = udp(fbed, src, dst)
        assert 240 <= got <= 360, (src, dst, got)
    assert udp(fbed, "host2", "host3") == COUNT                   # a link between two others keeps all
    assert udp(fbed, "host2", "host1", "control") == COUNT        # and the host's other link too
    # TCP gets through a lossy link, retransmitting
    assert probe(fbed, "host2", fbed.addr("host1", "data"), timeout=15)["echo"] == "ok"
    fbed.lossy("host1", "data", 100)                               # the same link again: replaced
    assert udp(fbed, "host2", "host1", count=100) == 0
    assert fbed.heal() == ["lossy:host1:data"]
    assert udp(fbed, "host2", "host1") == COUNT and udp(fbed, "host1", "host2") == COUNT


def _root_ruleset() -> str:
    nft = hosts_filter._nft_path()
    return subprocess.run([nft, "list", "ruleset"], capture_output=True, text=True, timeout=30).stdout


def test_closing_the_bed_removes_its_filters_even_after_a_failure(tmp_path):
    require_nft()
    before = _root_ruleset()
    netns = []
    with pytest.raises(RuntimeError, match="the test failed"):
        with HostBed(tmp_path / "bed", ["host1", "host2"], etcd=False) as hb:
            hb.drop_one_way("host1", "host2", "both")
            hb.lossy("host2", "data", 30)
            netns = [hb.host(n).netns for n in hb.names]
            assert all(hosts_filter.list_table(ns) for ns in netns)
            assert _root_ruleset() == before                       # nothing in the root namespace
            raise RuntimeError("the test failed")
    assert hb.leftovers() == []
    assert not any(hosts_filter.list_table(ns) for ns in netns)
    assert _root_ruleset() == before

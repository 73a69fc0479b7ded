"""The agent's data-network probes on the bed: a cut data link is seen as silence and a lost carrier,
and the peer answers again once the link is healed (``marind.agent.liveness.data_probe``); a port that
refuses, or another program on it, is not taken for the peer's probe listener
(``marind.agent.liveness.probe_handshake``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.agent.helpers import wait_for
from tests.hosts.conftest import PORT, bed  # noqa: F401 - the fixture

pytestmark = pytest.mark.hosts


def _lines(path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"outcome"' in line]


def test_probes_see_a_cut_data_link_and_its_heal(bed, tmp_path):  # noqa: F811 - the fixture
    listener = bed.popen("host2", [sys.executable, "-m", "tests.hosts.dataprobe", "listen"], stdout=subprocess.PIPE)
    assert listener.stdout is not None
    endpoint = json.loads(listener.stdout.readline())
    assert endpoint["addr"] == bed.addr("host2", "data"), endpoint     # the hostname's address: data
    out, stop = tmp_path / "watch.out", tmp_path / "stop"
    with open(out, "w") as fh:
        bed.popen("host1", [sys.executable, "-m", "tests.hosts.dataprobe", "watch", endpoint["addr"],
                            str(endpoint["port"]), str(stop), endpoint["token"]], stdout=fh)
    try:
        wait_for(lambda: any(r["outcome"] == "ok" for r in _lines(out)), 60, "host2 reached on data")
        assert _lines(out)[-1]["addr"] == bed.addr("host1", "data") and _lines(out)[-1]["link_up"]
        seen = len(_lines(out))
        bed.cut("host1", "data")
        wait_for(lambda: any(r["down_since"] and not r["link_up"] for r in _lines(out)[seen:]), 60,
                 "the cut seen: host2 silent, host1's own data link down")
        assert all(r["outcome"] != "refused" for r in _lines(out)[seen:]), "a cut link is silent"
        seen = len(_lines(out))
        bed.restore("host1", "data")
        wait_for(lambda: any(r["outcome"] == "ok" and r["down_since"] is None and r["link_up"]
                             for r in _lines(out)[seen:]), 60, "host2 answering again")
    finally:
        stop.touch()


def _watch(hb, tmp_path, name: str, addr: str, port: int, token: str) -> tuple:
    """A prober in host1 watching ``addr:port``: (its output file, its stop file)."""
    out, stop = tmp_path / f"{name}.out", tmp_path / f"{name}.stop"
    with open(out, "w") as fh:
        hb.popen("host1", [sys.executable, "-m", "tests.hosts.dataprobe", "watch", addr, str(port), str(stop), token],
                 stdout=fh)
    return out, stop


def test_a_refusing_port_or_another_program_is_not_the_peer(bed, tmp_path):  # noqa: F811 - the fixture
    """No firewall on the bed (no REJECT rule to add): a closed port on host2's data address refuses
    (the RST a REJECT sends), and an echo server there answers without the greeting. Both are
    down from the first probe on, while the link carries the packets."""
    from tests.hosts.conftest import serve
    serve(bed, "host2")           # the echo server of tests/hosts (PORT), on every address of host2
    addr = bed.addr("host2", "data")
    closed_out, closed_stop = _watch(bed, tmp_path, "closed", addr, 1, "0" * 16)
    echo_out, echo_stop = _watch(bed, tmp_path, "echo", addr, PORT, "0" * 16)
    try:
        for out, outcome in ((closed_out, "refused"), (echo_out, "no_greeting")):
            rows = wait_for(lambda out=out: (r := _lines(out)) and len(r) >= 5 and r, 60, f"{outcome} probes")
            assert all(r["outcome"] == outcome and r["down_since"] is not None and r["link_up"] for r in rows), rows
    finally:
        closed_stop.touch()
        echo_stop.touch()

"""The multi-host bed itself: hosts with their own names and addresses, two networks, silence on a cut,
and a teardown that leaves nothing behind (real namespaces, bridges and veths; needs root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from marind.core.etcd_client import EtcdClient
from marind.testing import hosts_net
from marind.testing.hosts import HostBed, bed_unavailable
from marind.testing.procs import REPO_ROOT, base_env
from tests.agent.helpers import wait_for
from tests.hosts.conftest import probe, require_bed, serve, state_of

pytestmark = pytest.mark.hosts


def _system_names(bed_id: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (netns + links).splitlines() if f"mb{bed_id}" in line or f"mb-{bed_id}" in line]


def test_each_host_has_its_hostname_addresses_and_resolver(bed):
    for name in bed.names:
        host = bed.host(name)
        out = bed.run(name, ["sh", "-c", "hostname; ip -o -4 addr show; getent hosts host1 host2 host1-ctl"],
                      check=True).stdout
        lines = out.splitlines()
        assert lines[0] == name
        assert f"ctl0    inet {host.control.addr}/24" in out and f"data0    inet {host.data.addr}/24" in out
        # a hostname is its data address; NAME-ctl its control one
        assert f"{bed.addr('host1', 'data')}" in out and f"{bed.addr('host2', 'data')}" in out
        assert f"{bed.addr('host1', 'control')}" in out
        # no way out: the host's only routes are its two /24s
        routes = bed.run(name, ["ip", "-4", "route"], check=True).stdout
        assert "default" not in routes
        assert sorted(r.split()[0] for r in routes.splitlines()) == sorted(bed.plan.subnets.values())
    assert bed.host("host1").netns != bed.host("host2").netns


def test_tcp_between_hosts_on_both_networks_and_by_hostname(bed):
    serve(bed, "host2")
    for net in ("control", "data"):
        got = probe(bed, "host1", bed.addr("host2", net))
        assert got["connect"] == "ok" and got["echo"] == "ok", got
        assert got["local"] == bed.addr("host1", net) and got["hostname"] == "host1"
    by_name = probe(bed, "host1", "host2")
    assert by_name["connect"] == "ok" and by_name["local"] == bed.addr("host1", "data")


def test_etcd_is_reachable_from_every_host_on_the_control_network(bed):
    prefix = f"/bed-{uuid.uuid4().hex[:8]}"
    code = ("import sys; from marind.core.etcd_client import EtcdClient\n"
            "c = EtcdClient(sys.argv[1], prefix=sys.argv[2]); c.put_json(c.key('from', sys.argv[3]), {'ok': 1})")
    assert bed.plan.etcd.startswith(f"http://{bed.plan.server_addrs['control']}:")
    for name in bed.names:
        res = bed.python(name, code, bed.plan.etcd, prefix, name)
        assert res.returncode == 0, res.stderr
    with EtcdClient(bed.plan.etcd, prefix=prefix) as client:
        assert all(client.get_json(client.key("from", n)) == {"ok": 1} for n in bed.names)
    # with its control link cut, a host reaches etcd no more
    bed.cut("host1", "control")
    res = bed.python("host1", "import socket, sys; socket.create_connection((sys.argv[1], 2379), timeout=1)",
                     bed.plan.server_addrs["control"])
    assert res.returncode != 0 and "timed out" in res.stderr


def test_a_cut_data_link_is_silent_and_the_control_link_still_works(bed, tmp_path):
    serve(bed, "host2")
    go = tmp_path / "go"
    held = bed.popen("host1", [sys.executable, "-m", "tests.hosts.netprobe", "probe", bed.addr("host2", "data"),
                               "7411", "--timeout", "2", "--wait-file", str(go)], stdout=subprocess.PIPE)
    wait_for(lambda: (tmp_path / "go.ready").exists() or held.poll() is not None, 60, "the probe connected")
    assert not hosts_net.link_is_up(bed.cut("host2", "data")[0])
    go.write_text("1")
    out, _ = held.communicate(timeout=60)
    established = json.loads(out)
    # an established connection: the reply never comes (no RST); a new one: the SYN goes unanswered
    assert established["echo"] == "ok" and established["recv"] == "timeout", established
    assert probe(bed, "host1", bed.addr("host2", "data"), timeout=2)["connect"] == "timeout"
    assert probe(bed, "host1", bed.addr("host2", "control"))["echo"] == "ok"
    bed.restore("host2", "data")
    assert probe(bed, "host1", bed.addr("host2", "data"), timeout=10)["echo"] == "ok"


def test_teardown_removes_everything_also_after_an_exception(tmp_path):
    require_bed()
    hb = HostBed(tmp_path / "ok", ["a1", "a2", "a3"], etcd=False)
    with hb:
        bed_id = hb.plan.bed_id
        hb.popen("a1", ["sleep", "300"])
        hb.popen("a2", ["sh", "-c", "sleep 300 & sleep 300"])   # a child outside the group's reach
        assert len(_system_names(bed_id)) >= 3 + 8
    assert hb.leftovers() == [] and _system_names(bed_id) == []
    assert not hb.state_path.exists()

    hb = HostBed(tmp_path / "boom", ["b1", "b2"])
    with pytest.raises(RuntimeError, match="boom"), hb:
        bed_id = hb.plan.bed_id
        etcd_pid = hb.etcd.pid
        hb.popen("b2", ["sleep", "300"])
        hb.cut("b1", "both")
        assert hb.power_off("b2")                        # stopped processes are killed too
        raise RuntimeError("boom")
    assert hb.leftovers() == [] and _system_names(bed_id) == []
    assert not (hosts_net.ETC_NETNS / f"mb-{bed_id}-b1").exists()
    wait_for(lambda: state_of(etcd_pid) in "-Z", 10, "the bed's etcd stopped")


_ORPHAN = """
import sys, time
from marind.testing.hosts import HostBed, bed_unavailable
from marind.testing.procs import REPO_ROOT, base_env
bed = HostBed(sys.argv[1], ["c1", "c2"]).start()
bed.popen("c1", ["sleep", "300"])
print(bed.plan.bed_id, bed.etcd.pid, flush=True)
time.sleep(300)
"""


def test_a_bed_whose_owner_was_killed_is_removed_by_the_next_bed(tmp_path):
    require_bed()
    owner = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(tmp_path / "orphan")], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        bed_id, etcd_pid = owner.stdout.readline().split()
    finally:
        owner.kill()                      # SIGKILL: no teardown runs
        owner.wait()
    assert len(_system_names(bed_id)) >= 2 + 4
    with HostBed(tmp_path / "next", ["d1"], etcd=False) as hb:
        assert _system_names(bed_id) == []          # swept when this bed started
    assert hb.leftovers() == []
    assert not (hosts_net.ETC_NETNS / f"mb-{bed_id}-c1").exists()
    wait_for(lambda: state_of(int(etcd_pid)) in "-Z", 10, "the orphaned etcd killed")


def test_s3_on_the_control_network_from_a_host(tmp_path):
    require_bed()
    with HostBed(tmp_path / "s3bed", ["e1"], s3=True) as hb:
        assert hb.plan.s3 == hb.s3.endpoint and hb.plan.s3.startswith(f"http://{hb.plan.server_addrs['control']}:")
        code = ("import json, sys, s3fs\n"
                "fs = s3fs.S3FileSystem(skip_instance_cache=True, **json.loads(sys.argv[1]))\n"
                "fs.pipe(sys.argv[2], b'from e1'); print(fs.cat(sys.argv[2]).decode())")
        res = hb.python("e1", code, json.dumps(hb.s3.storage_options), f"{hb.s3.bucket}/probe", timeout=120)
        assert res.returncode == 0 and res.stdout.strip() == "from e1", res.stderr[-2000:]


def test_without_root_the_bed_tests_skip_with_one_line():
    if os.geteuid() != 0:
        assert bed_unavailable() == "the multi-host bed needs root (network namespaces)"
        return
    with tempfile.TemporaryDirectory() as scratch:        # pytest's own tmp dirs are root's only
        os.chmod(scratch, 0o777)
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "pytest",
               "-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={scratch}/pt",
               "tests/hosts/test_bed.py::test_tcp_between_hosts_on_both_networks_and_by_hostname"]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=base_env(), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 skipped" in res.stdout and "the multi-host bed needs root (network namespaces)" in res.stdout

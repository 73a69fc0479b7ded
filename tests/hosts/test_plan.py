"""The bed's plan without any namespace: names, addresses, hosts file, state file, /proc/net/tcp."""

from __future__ import annotations

import random

import pytest

from marind.testing import hosts_plan as hp
from marind.testing.hosts_net import established_tcp

pytestmark = pytest.mark.unit


def _plan(names=("host1", "host2", "host3"), bed_id="a1b2c3"):
    return hp.plan_bed(list(names), bed_id, ("10.40.8.0/24", "10.40.9.0/24"))


def test_names_carry_the_bed_id_and_fit_linux_interface_names():
    plan = _plan([f"h{i}" for i in range(1, hp.MAX_HOSTS + 1)])
    links = [h.link(n) for h in plan.hosts for n in hp.NETS]
    names = [*plan.bridges.values(), *(link.veth for link in links)]
    assert max(len(n) for n in names) <= 15
    assert len(set(names)) == len(names) and all("a1b2c3" in n for n in names)
    assert plan.hosts[0].netns == "mb-a1b2c3-h1"
    assert {link.ifname for link in links} == {"ctl0", "data0"}


def test_addresses_bridge_side_and_hosts():
    plan = _plan()
    assert plan.server_addrs == {"control": "10.40.8.1", "data": "10.40.9.1"}
    assert [h.control.addr for h in plan.hosts] == ["10.40.8.11", "10.40.8.12", "10.40.8.13"]
    assert plan.host("host2").data.addr == "10.40.9.12"
    with pytest.raises(KeyError, match="host1, host2, host3"):
        plan.host("host9")


@pytest.mark.parametrize("names, match", [
    ([], "1 to 200"), (["Host1"], "bad hostname"), (["h_1"], "bad hostname"), (["1h"], "bad hostname"),
    (["h1", "h2", "h1"], "duplicate hostnames"), (["x" * 32], "bad hostname"),
])
def test_bad_hostnames_are_refused(names, match):
    with pytest.raises(ValueError, match=match):
        hp.plan_bed(names, "a1b2c3", ("10.40.8.0/24", "10.40.9.0/24"))


def test_bad_ids_and_subnets_are_refused():
    with pytest.raises(ValueError, match="bed id"):
        hp.plan_bed(["h1"], "XYZ", ("10.40.8.0/24", "10.40.9.0/24"))
    with pytest.raises(ValueError, match="/24"):
        hp.plan_bed(["h1"], "a1b2c3", ("10.40.0.0/16", "10.41.0.0/16"))


def test_subnets_avoid_networks_in_use_and_follow_the_seed():
    rng = random.Random(3)
    first = hp.choose_subnets(rng, [])
    assert hp.choose_subnets(random.Random(3), []) == first
    ctl, data = hp.choose_subnets(random.Random(3), [first[1], "192.168.0.0/16"])
    assert (ctl, data) != first and ctl.startswith("10.") and data.startswith("10.")
    with pytest.raises(RuntimeError, match="no free pair"):
        hp.choose_subnets(random.Random(1), ["10.0.0.0/8"])


def test_hosts_file_puts_hostnames_on_the_data_network():
    text = hp.hosts_file(_plan())
    assert "10.40.9.11\thost1 host1-data\n" in text
    assert "10.40.8.11\thost1-ctl\n" in text
    assert "10.40.8.1\tbed-server bed-server-ctl\n" in text
    assert text.startswith("127.0.0.1\tlocalhost\n")


def test_host_env_pins_collectives_to_the_data_link():
    env = hp.host_env(_plan())
    assert env["GLOO_SOCKET_IFNAME"] == "data0" == env["NCCL_SOCKET_IFNAME"]
    assert "MARIND_ETCD" not in env
    from dataclasses import replace
    assert hp.host_env(replace(_plan(), etcd="http://10.40.8.1:2379"))["MARIND_ETCD"] == "http://10.40.8.1:2379"


def test_state_file_round_trip(tmp_path):
    from dataclasses import replace
    plan = _plan()
    plan = replace(plan, hosts=tuple(replace(h, holder_pid=100 + i) for i, h in enumerate(plan.hosts)),
                   etcd="http://10.40.8.1:2379")
    hp.write_state(tmp_path / hp.STATE_FILE, plan)
    assert hp.read_state(tmp_path) == plan
    assert hp.read_state(tmp_path / hp.STATE_FILE) == plan
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        hp.read_state(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        hp.read_state(tmp_path / "none")


def test_nets_of():
    assert hp.nets_of("both") == ["control", "data"] and hp.nets_of("data") == ["data"]
    with pytest.raises(ValueError, match="control, data or both"):
        hp.nets_of("wifi")


def test_established_tcp_parses_proc_net_tcp():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0B28280A:1CF3 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n"
            "   1: 0B29280A:A1B2 0C29280A:1CF3 01 00000000:00000000 00:00000000 00000000     0        0 2\n")
    assert established_tcp(text) == [("10.40.41.11:41394", "10.40.41.12:7411")]
    text6 = ("  sl  local_address                         remote_address                        st\n"
             "   0: 0000000000000000FFFF00000B48D30A:AB08 0000000000000000FFFF00000148D30A:86E7 01 0\n"
             "   1: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 0\n")
    assert established_tcp(text6) == [("10.211.72.11:43784", "10.211.72.1:34535")]

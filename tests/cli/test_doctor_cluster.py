"""`marind doctor --cluster`: the pure decisions, and real probes on loopback against a real etcd.

The agents' part (a watch on the request, one probe per host) runs on the
multi-host bed: tests/hosts/test_doctor_cluster_on_bed.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest

import marind.commands.cluster_check as cc
from marind.cli import main
from marind.commands.cluster_check import run_check
from marind.commands.doctor import cluster_table
from marind.core.etcd_client import EtcdClient
from marind.doctor_cluster.keys import Phases, Request, requests_prefix, run_key
from marind.doctor_cluster.verdict import Group, HostResult, build_report, bus_bandwidth, choose_group
from marind.testing.procs import spawn
from tests.agent.helpers import agent_log, node_registered, start_agent, wait_for

H3 = ("host1", "host2", "host3")


def matrix(hosts, broken=()):
    """Every link ok but the (src, dst) pairs in ``broken`` (timeout)."""
    return {s: {d: ("timeout" if (s, d) in broken else "ok") for d in hosts if d != s} for s in hosts}


def cut(host, hosts):
    """``host``'s data link down: nothing in or out."""
    return [(host, o) for o in hosts if o != host] + [(o, host) for o in hosts if o != host]


@pytest.mark.unit
def test_all_links_up_every_host_is_a_member():
    group = choose_group(H3, matrix(H3))
    assert group.members == H3 and group.excluded == {}


@pytest.mark.unit
@pytest.mark.parametrize("lost", H3)
def test_a_cut_host_is_left_out_and_the_others_stay(lost):
    group = choose_group(H3, matrix(H3, cut(lost, H3)))
    assert group.members == tuple(h for h in H3 if h != lost)
    assert set(group.excluded) == {lost}
    others = [h for h in H3 if h != lost]
    assert group.excluded[lost] == (f"not reachable from {others[0]} (timeout), {others[1]} (timeout); "
                                    f"cannot reach {others[0]} (timeout), {others[1]} (timeout)")


@pytest.mark.unit
def test_two_hosts_that_cannot_reach_each_other_both_fail():
    hosts = ("a", "b")
    group = choose_group(hosts, matrix(hosts, cut("a", hosts)))
    assert group.members == () and set(group.excluded) == {"a", "b"}
    assert group.excluded["a"].startswith("not reachable from b (timeout); cannot reach b (timeout)")
    assert "cannot tell which one is at fault" in group.excluded["b"]


@pytest.mark.unit
def test_one_broken_link_drops_both_its_ends_only():
    hosts = ("a", "b", "c", "d")
    group = choose_group(hosts, matrix(hosts, [("b", "c")]))
    assert group.members == ("a", "d")
    assert group.excluded == {"b": "cannot reach c (timeout)", "c": "not reachable from b (timeout)"}


@pytest.mark.unit
def test_a_host_without_a_row_is_never_a_member():
    reach = matrix(H3)
    del reach["host2"]
    group = choose_group(H3, reach)
    assert group.members == ("host1", "host3")
    assert "no reachability report" in group.excluded["host2"]


@pytest.mark.unit
def test_bus_bandwidth_is_2_n_minus_1_over_n_bytes_per_second():
    assert bus_bandwidth(1000, 1.0, 2) == 1000
    assert bus_bandwidth(3000, 2.0, 3) == 2000
    assert bus_bandwidth(1000, 1.0, 1) is None
    assert bus_bandwidth(1000, 0.0, 2) is None


@pytest.mark.unit
def test_report_names_the_failing_hosts_and_why():
    hosts = ("a", "b", "c", "d")
    reach = matrix(("a", "b", "c"), cut("c", ("a", "b", "c")))
    plan = choose_group(hosts, reach)
    results = {"a": HostResult("a", "ha", 0, 2, "gloo", 1e-4, 5e8),
               "b": HostResult("b", "hb", 1, 2, "gloo", error="barrier failed: boom"),
               "c": HostResult("c", "hc", error=plan.excluded["c"])}
    del results["c"]                    # its probe's result is late: the row still says which host it is
    report = build_report("r", hosts, 1024, reported={"a": "ha", "b": "hb", "c": "hc"}, reach=reach, plan=plan, results=results)
    rows = {r.node: r for r in report.rows}
    assert not report.ok and report.failing == ("b", "c", "d")
    assert rows["a"].ok and rows["a"].latency_s == 1e-4 and rows["a"].reachable_from == 1
    assert rows["b"].error == "barrier failed: boom"
    assert rows["c"].host == "hc" and rows["c"].error.startswith("not reachable from a (timeout), b (timeout)") and rows["c"].reachable_from == 0
    assert "no probe reported" in rows["d"].error
    doc = report.to_dict()
    assert doc["schema_version"] == 1 and doc["backend"] == "gloo" and doc["world_size"] == 2
    assert [h["node"] for h in doc["hosts"]] == list(hosts)


@pytest.mark.unit
def test_a_member_without_a_result_fails():
    report = build_report("r", ("a", "b"), 8, reported={"a": "ha", "b": "hb"}, reach=matrix(("a", "b")),
                          plan=Group(("a", "b")), results={"a": HostResult("a", "ha", 0, 2, "gloo", 1e-4, 1e9)})
    assert report.failing == ("b",) and "no result within the timeout" in report.rows[1].error


@pytest.mark.unit
def test_request_round_trips_and_rejects_junk():
    req = Request(id="20260101-000000-abcd", hosts=("a", "b"), bytes=1 << 20, timeout_s=30.0, by="me@x")
    assert Request.from_dict(req.to_dict()) == req
    for bad in ({}, {"id": "x", "hosts": [], "bytes": 8, "timeout_s": 1}, req.to_dict() | {"id": "../x"},
                req.to_dict() | {"bytes": "many"}):
        with pytest.raises(ValueError, match="not a cluster-check request"):
            Request.from_dict(bad)


@pytest.mark.unit
@pytest.mark.parametrize("timeout", [10.0, 90.0, 600.0])
def test_the_probe_phases_fit_in_the_timeout(timeout):
    p = Phases.of(timeout)
    assert 2 * p.gather_s + p.connect_s + p.collective_s < timeout


@pytest.mark.unit
@pytest.mark.parametrize("flags", [["--cluster", "--bytes", "2"], ["--cluster", "--timeout", "1"], ["--bytes", "64"]])
def test_bad_cluster_flags_exit_2(flags, capsys):
    assert main(["doctor", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: doctor") and "--cluster" in err and err.count("\n") == 1


@pytest.mark.unit
def test_the_table_has_a_row_per_host_and_names_the_failing_one():
    hosts = ("host1", "host2", "host3")
    reach = matrix(hosts, cut("host1", hosts))
    plan = choose_group(hosts, reach)
    results = {"host1": HostResult("host1", "host1", error=plan.excluded["host1"]),
               "host2": HostResult("host2", "host2", 0, 2, "gloo", 2.5e-4, 1.5e9),
               "host3": HostResult("host3", "host3", 1, 2, "gloo", 3e-4, 1.25e9)}
    report = build_report("r", hosts, 1 << 20, reported={h: h for h in hosts}, reach=reach, plan=plan, results=results)
    lines = cluster_table(report)
    assert lines[0].split() == ["NODE", "HOST", "REACHABLE", "LATENCY", "BUS", "BW", "RESULT"]
    assert lines[1].startswith("host1") and "0/2" in lines[1] and "FAIL: not reachable from host2 (timeout)" in lines[1]
    assert lines[2].split() == ["host2", "host2", "1/2", "0.25", "ms", "1.50", "GB/s", "ok"]
    assert lines[3].split() == ["host3", "host3", "1/2", "0.30", "ms", "1.25", "GB/s", "ok"]
    assert lines[-2] == "2 of 3 host(s) all-reduced 1048576 bytes (gloo)."
    assert lines[-1] == "FAILING: host1"


def test_probes_on_loopback_measure_and_name_the_host_without_one(etcd, etcd_prefix):
    """Three real probes (started here, as their agents would) and a fourth host with none."""
    procs: list[subprocess.Popen] = []
    with EtcdClient(etcd.endpoint, prefix=etcd_prefix) as client:
        def start_probes():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                keys = client.get_prefix_keys(requests_prefix(client))
                if keys:
                    rid = keys[0].rsplit("/", 1)[-1]
                    procs.extend(spawn([sys.executable, "-m", "marind.doctor_cluster.probe", "--etcd", etcd.endpoint,
                                        "--prefix", etcd_prefix, "--request", rid, "--node", n])
                                 for n in ("a", "b", "c"))
                    return
                time.sleep(0.1)
        helper = threading.Thread(target=start_probes, daemon=True)
        helper.start()
        report = run_check(client, ["a", "b", "c", "d"], nbytes=1 << 20, timeout_s=40)
        helper.join(5)
        assert client.get_prefix_keys(client.key("doctor") + "/") == []     # request and run keys gone
    assert [p.wait(30) for p in procs] == [0, 0, 0]
    rows = {r.node: r for r in report.rows}
    assert report.failing == ("d",) and report.world_size == 3 and report.backend == "gloo"
    for node in "abc":
        assert rows[node].ok and rows[node].rank == "abc".index(node), rows[node]
        assert rows[node].latency_s and rows[node].bus_bandwidth and rows[node].reachable_from == 2
    assert "no probe reported" in rows["d"].error


def test_two_agents_on_loopback_pass_the_text_check(etcd, etcd_prefix, tmp_path, capsys, monkeypatch):
    """The whole path without the bed: two real agents each start their probe; the table, exit 0."""
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    for node in ("n1", "n2"):
        start_agent(tmp_path, node, etcd.endpoint, etcd_prefix)
    with EtcdClient(etcd.endpoint, prefix=etcd_prefix) as client:
        wait_for(lambda: node_registered(client, "n1") and node_registered(client, "n2"), 60, "two agents",
                 diag=lambda: agent_log(tmp_path, "n1") + agent_log(tmp_path, "n2"))
    rc = main(["doctor", "--cluster", "--etcd", etcd.endpoint, "--bytes", str(1 << 20), "--timeout", "40"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, "\n".join(lines)
    assert [line.split()[0] for line in lines[1:3]] == ["n1", "n2"]
    assert all(line.split()[2] == "1/1" and line.endswith("  ok") and "GB/s" in line for line in lines[1:3]), lines
    assert lines[-2:] == [f"2 of 2 host(s) all-reduced {1 << 20} bytes (gloo).", "All 2 hosts passed."]
    assert (tmp_path / "state-n1" / "doctor").is_dir()       # the probe's log, by its agent


def test_results_that_land_between_two_polls_are_in_the_report(etcd, etcd_prefix, monkeypatch):
    """Every probe's rows land just before the CLI decides the check is finished (the CI failure of
    stop 27: a report read before that decision named every host as silent)."""
    real_finished = cc.finished
    hosts = ("a", "b")

    def probes_finish_now(client, request):
        if client.get_json(run_key(client, request.id, "plan")) is None:
            for node in hosts:
                client.put_json(run_key(client, request.id, "addr", node),
                                {"node": node, "host": node, "addr": "127.0.0.1", "port": 1})
                client.put_json(run_key(client, request.id, "reach", node), {o: "ok" for o in hosts if o != node})
                result = HostResult(node=node, host=node, rank=hosts.index(node), world_size=2, backend="gloo",
                                    latency_s=1e-4, bus_bandwidth=1e9, error=None)
                client.put_json(run_key(client, request.id, "result", node), asdict(result))
            client.put_json(run_key(client, request.id, "plan"), choose_group(hosts, matrix(hosts)).to_dict())
        return real_finished(client, request)

    monkeypatch.setattr(cc, "finished", probes_finish_now)
    with EtcdClient(etcd.endpoint, prefix=etcd_prefix) as client:
        report = run_check(client, list(hosts), nbytes=1 << 20, timeout_s=20)
    assert report.ok and report.failing == () and [r.rank for r in report.rows] == [0, 1], report

"""chaos/power_off.py and chaos/partition.py on the bed: which processes stop, which links go, and
that everything comes back (real namespaces, real signals; needs root)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from marind.testing import hosts_net
from marind.testing.procs import REPO_ROOT, base_env
from tests.agent.helpers import wait_for
from tests.hosts.conftest import probe, serve, state_of

pytestmark = pytest.mark.hosts


def _injector(name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "chaos" / f"{name}.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(env),
                            cwd=REPO_ROOT)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, list[dict], str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.strip()], err


def _sleepers(bed) -> dict[str, int]:
    procs = {name: bed.popen(name, ["sleep", "300"]) for name in bed.names}
    wait_for(lambda: all(p.pid in bed.pids(n) for n, p in procs.items()), 10, "sleepers in their hosts")
    return {name: p.pid for name, p in procs.items()}


def test_power_off_back_after_stops_only_that_host_then_resumes_it(bed):
    serve(bed, "host1")
    pids = _sleepers(bed)
    holder = bed.host("host1").holder_pid
    proc = _injector("power_off", "--bed", str(bed.root), "--host", "host1", "--back-after", "8")
    first = proc.stdout.readline()
    off = json.loads(first)
    assert off["action"] == "power_off" and off["target"] == "host1" and off["back_after"] == 8
    assert pids["host1"] in off["stopped"] and pids["host2"] not in off["stopped"]
    assert holder not in off["stopped"]
    # while off: host1's processes are stopped, host2's run; both links down; peers see silence
    assert state_of(pids["host1"]) == "T" and state_of(pids["host2"]) in "SR"
    assert all(state_of(p) == "T" for p in bed.pids("host1") if p != holder)
    assert not any(hosts_net.link_is_up(v) for v in off["links"])
    assert probe(bed, "host2", bed.addr("host1", "control"), timeout=1)["connect"] == "timeout"
    rc, rest, err = _finish(proc)
    assert rc == 0, err
    assert [line["action"] for line in rest] == ["power_on"]
    assert pids["host1"] in rest[0]["resumed"] and pids["host2"] not in rest[0]["resumed"]
    assert state_of(pids["host1"]) in "SR"
    assert all(hosts_net.link_is_up(v) for v in off["links"])
    assert probe(bed, "host2", bed.addr("host1", "data"), timeout=10)["echo"] == "ok"


def test_power_off_forever_kills_that_host_s_processes_only(bed):
    pids = _sleepers(bed)
    rc, lines, err = _finish(_injector("power_off", "--host", "host2", "--forever",
                                       env={"MARIND_BED": str(bed.root)}))
    assert rc == 0, err
    assert [line["action"] for line in lines] == ["power_off", "kill"]
    assert pids["host2"] in lines[1]["killed"]
    wait_for(lambda: state_of(pids["host2"]) in "-Z", 10, "host2's sleeper gone")
    assert state_of(pids["host1"]) in "SR"
    assert bed.pids("host2") == [bed.host("host2").holder_pid]     # the machine is there, powered off
    assert not any(hosts_net.link_is_up(v) for v in lines[0]["links"])


def test_partition_cuts_one_network_and_heals(bed):
    serve(bed, "host1")
    pids = _sleepers(bed)
    proc = _injector("partition", "--bed", str(bed.root), "--host", "host1", "--net", "data", "--seconds", "8")
    cut = json.loads(proc.stdout.readline())
    assert cut["action"] == "partition" and cut["nets"] == ["data"] and cut["links"] == [bed.host("host1").data.veth]
    assert probe(bed, "host2", bed.addr("host1", "data"), timeout=1)["connect"] == "timeout"
    assert probe(bed, "host2", bed.addr("host1", "control"))["echo"] == "ok"
    assert state_of(pids["host1"]) in "SR"                        # a partition stops nothing
    rc, rest, err = _finish(proc)
    assert rc == 0, err
    assert [line["action"] for line in rest] == ["heal"]
    assert probe(bed, "host2", bed.addr("host1", "data"), timeout=10)["echo"] == "ok"


def test_partition_keeping_the_carrier_drops_frames_with_both_links_up(bed):
    """A switch dropping a host's traffic: silence both ways, yet the host's own link looks fine."""
    serve(bed, "host1")
    proc = _injector("partition", "--bed", str(bed.root), "--host", "host1", "--net", "data", "--seconds", "8",
                     "--keep-carrier")
    cut = json.loads(proc.stdout.readline())
    assert cut["action"] == "partition" and cut["carrier"] is True
    assert all(hosts_net.link_is_up(v) for v in cut["links"])
    assert probe(bed, "host2", bed.addr("host1", "data"), timeout=1)["connect"] == "timeout"
    assert probe(bed, "host2", bed.addr("host1", "control"))["echo"] == "ok"
    carrier = subprocess.run(["ip", "netns", "exec", bed.host("host1").netns, sys.executable, "-c",
                              f"from marind.agent.liveness.data_probe import link_up; print(link_up({bed.addr('host1', 'data')!r}))"],
                             capture_output=True, text=True, env=base_env(), cwd=REPO_ROOT, timeout=60)
    assert carrier.stdout.strip() == "True", carrier.stderr      # the host cannot tell from its link
    rc, rest, err = _finish(proc)
    assert rc == 0, err
    assert [line["action"] for line in rest] == ["heal"]
    assert probe(bed, "host2", bed.addr("host1", "data"), timeout=10)["echo"] == "ok"


def test_partition_both_and_sigterm_heals_early(bed):
    proc = _injector("partition", "--bed", str(bed.root), "--host", "host2", "--net", "both", "--seconds", "600")
    cut = json.loads(proc.stdout.readline())
    assert len(cut["links"]) == 2 and not any(hosts_net.link_is_up(v) for v in cut["links"])
    proc.terminate()
    rc, rest, err = _finish(proc)
    assert rc == 0, err
    assert [line["action"] for line in rest] == ["heal"]
    assert all(hosts_net.link_is_up(v) for v in cut["links"])


def test_injectors_with_nothing_to_act_on(bed, tmp_path):
    rc, lines, err = _finish(_injector("power_off", "--bed", str(bed.root), "--host", "nosuch"))
    assert (rc, lines) == (1, []) and "no host 'nosuch'" in err
    rc, lines, err = _finish(_injector("partition", "--bed", str(tmp_path / "nobed"), "--host", "host1",
                                       "--net", "data", "--seconds", "1"))
    assert (rc, lines) == (1, []) and "no bed state" in err
    rc, _, err = _finish(_injector("power_off", "--host", "host1", env={"MARIND_BED": ""}))
    assert rc == 2 and "--bed" in err
    rc, _, err = _finish(_injector("partition", "--bed", str(bed.root), "--net", "wifi", "--seconds", "1"))
    assert rc == 2 and "invalid choice" in err
    assert all(hosts_net.link_is_up(h.link(n).veth) for h in bed.plan.hosts for n in ("control", "data"))


def test_power_off_in_process_and_back(bed):
    pids = _sleepers(bed)
    frozen = bed.power_off("host1")
    assert [f.pid for f in frozen] == [pids["host1"]] and state_of(pids["host1"]) == "T"
    assert state_of(pids["host2"]) in "SR"
    assert bed.power_on("host1", frozen) == [pids["host1"]]
    assert state_of(pids["host1"]) in "SR"

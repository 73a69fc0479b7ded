"""deploy/kubernetes/*.yaml against the Kubernetes schemas, offline, plus what the schemas cannot see.

The validator is ``kubernetes-validate`` (PyPI; the test extras): it ships the JSON schemas of each
Kubernetes release in the package, so validation reads no network (checked below by running it with
every socket call refused, and by its CLI inside a network namespace with no interface up when this
machine allows one). Strict mode refuses unknown fields. No cluster runs here: these are schema checks,
and marind's own checks of the configs the manifests carry (marind.toml, run.toml).
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

from marind.control.config import parse_config_text
from marind.core.spec import load_spec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
#: The oldest release still supported upstream when this was written, and the newest the validator ships.
VERSIONS = ("1.30.0", "1.37.0")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in _docs(path):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _validate(doc: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)   # SchemaNotFoundError for an unknown kind


@pytest.mark.unit
def test_every_manifest_validates_strictly_offline(monkeypatch):
    def refused(*_a, **_k):
        raise AssertionError("the validator tried to reach the network")
    for name in ("getaddrinfo", "create_connection"):
        monkeypatch.setattr(socket, name, refused)
    monkeypatch.setattr(socket.socket, "connect", refused)
    files = sorted(DEPLOY.glob("*.yaml"))
    assert len(files) >= 5
    kinds = set()
    for path in files:
        for doc in _docs(path):
            _validate(doc)
            kinds.add(doc["kind"])
    assert {"Namespace", "Service", "StatefulSet", "ConfigMap", "DaemonSet", "Job"} <= kinds


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_the_validator_cli_runs_with_no_network():
    cli = Path(sys.executable).with_name("kubernetes-validate")
    files = [str(p) for p in sorted(DEPLOY.glob("*.yaml"))]
    out = subprocess.run(["unshare", "--net", "--", str(cli), "--strict", "-k", VERSIONS[-1], *files],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ERROR" not in out.stdout and "WARN" not in out.stdout, out.stdout + out.stderr
    assert out.stdout.count("passed for resource") == sum(len(_docs(Path(f))) for f in files)


# not `unit`: these run the validator's CLI as a process too
@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "unknown kind"])
def test_a_broken_manifest_fails(tmp_path, breakage):
    ds = copy.deepcopy(_all()[("DaemonSet", "marind-agent")])
    pod = ds["spec"]["template"]["spec"]
    if breakage == "unknown field":
        pod["hostNetwrok"] = pod.pop("hostNetwork")                 # a typo strict mode must catch
        expected: type[Exception] = ValidationError
    elif breakage == "wrong type":
        pod["terminationGracePeriodSeconds"] = "two minutes"
        expected = ValidationError
    else:
        ds["apiVersion"] = "apps/v1beta9"
        expected = SchemaNotFoundError
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(ds))
    with pytest.raises(expected):
        for doc in _docs(broken):
            _validate(doc)
    cli = Path(sys.executable).with_name("kubernetes-validate")
    out = subprocess.run([str(cli), "--strict", "-k", VERSIONS[-1], str(broken)], capture_output=True, text=True,
                         timeout=120)
    if expected is SchemaNotFoundError:       # the CLI only warns about a kind it has no schema for
        assert "WARN" in out.stdout and "Couldn't find schema" in out.stdout, out.stdout
    else:
        assert out.returncode == 1 and "ERROR" in out.stdout and "did not validate" in out.stdout, out.stdout


@pytest.mark.unit
def test_etcd_members_and_the_agents_endpoints_agree():
    docs = _all()
    sts, svc = docs[("StatefulSet", "etcd")], docs[("Service", "etcd")]
    ns, name, replicas = sts["metadata"]["namespace"], sts["spec"]["serviceName"], sts["spec"]["replicas"]
    assert replicas == 3 and svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {2379, 2380} and svc["metadata"]["name"] == name
    members = [f"etcd-{i}.{name}.{ns}.svc.cluster.local" for i in range(replicas)]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster=")).split("=", 1)[1]
    assert cluster == ",".join(f"etcd-{i}=http://{m}:2380" for i, m in enumerate(members))
    config = parse_config_text(docs[("ConfigMap", "marind-config")]["data"]["marind.toml"])
    assert config["etcd"] == ",".join(f"http://{m}:2379" for m in members)


@pytest.mark.unit
def test_agent_pod_is_the_systemd_unit():
    docs = _all()
    pod = docs[("DaemonSet", "marind-agent")]["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    cmd = agent["command"]
    assert cmd[:2] == ["marind", "agent"] and cmd[cmd.index("--node") + 1] == "$(NODE_NAME)"
    node_env = next(e for e in agent["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == cmd[cmd.index("--state-dir") + 1] == "/var/lib/marind"
    sc = agent["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["tolerations"] and pod["nodeSelector"]
    config = parse_config_text(docs[("ConfigMap", "marind-config")]["data"]["marind.toml"])
    assert pod["terminationGracePeriodSeconds"] > float(config["stop_timeout"])    # a save in flight may finish
    assert agent["livenessProbe"]["httpGet"]["path"] != "/healthz"                  # an etcd outage is not a death


@pytest.mark.unit
def test_submit_job_carries_a_valid_run_toml():
    docs = _all()
    job = docs[("Job", "marind-submit-example")]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["marind", "submit", "--wait"] and job["spec"]["backoffLimit"] == 0
    spec = load_spec(docs[("ConfigMap", "marind-run-example")]["data"]["run.toml"])
    assert spec.job.command and spec.job.working_dir == "/workspace" and spec.job.nodes == (2, 4)

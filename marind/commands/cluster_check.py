"""The CLI's side of `marind doctor --cluster`: write the request, wait for the probes, report, clean up.

The request lives under a lease of ``timeout_s + 30`` seconds, so a CLI
killed mid-check leaves no request an agent would still act on; its run's
keys are swept by the next check.
"""

from __future__ import annotations

import time

from marind.control.nodes import live_nodes
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.doctor_cluster.keys import Request, new_request_id, request_key, requests_prefix, run_key, run_prefix
from marind.doctor_cluster.verdict import Group, HostResult, Report, build_report

POLL_S = 0.25
LEASE_MARGIN_S = 30
#: how long past ``timeout_s`` the CLI waits: a probe starts a moment after the request, and its
#: watchdog reports at ``timeout_s`` after its own start
WAIT_MARGIN_S = 10

log = get_logger("doctor_cluster.client")


def registered_hosts(client: EtcdClient) -> list[str]:
    """The registered nodes' names, sorted: the check's hosts in rank order."""
    return sorted(live_nodes(client))


def _rows(client: EtcdClient, request_id: str, what: str) -> dict:
    prefix = run_key(client, request_id, what) + "/"
    return {k.rsplit("/", 1)[-1]: v for k, v in client.get_prefix_json(prefix).items() if isinstance(v, dict)}


def collect(client: EtcdClient, request: Request) -> Report:
    """The report from what the probes have written so far."""
    plan_doc = client.get_json(run_key(client, request.id, "plan"))
    results = {n: HostResult.from_dict(v) for n, v in _rows(client, request.id, "result").items()}
    return build_report(request.id, request.hosts, request.bytes,
                        reported={n: str(v.get("host", "")) for n, v in _rows(client, request.id, "addr").items()},
                        reach=_rows(client, request.id, "reach"),
                        plan=Group.from_dict(plan_doc) if isinstance(plan_doc, dict) else None, results=results)


def finished(client: EtcdClient, request: Request) -> bool:
    """Every host has a result, or the group is decided and every probe that started has one
    (a host whose probe never started will not send one)."""
    done = set(_rows(client, request.id, "result"))
    if done >= set(request.hosts):
        return True
    return (client.get_json(run_key(client, request.id, "plan")) is not None
            and done >= set(_rows(client, request.id, "addr")))


def sweep_runs(client: EtcdClient) -> list[str]:
    """Delete the keys of runs whose request is gone (a CLI killed mid-check); their ids."""
    base = client.key("doctor", "runs") + "/"
    live = {k.rsplit("/", 1)[-1] for k in client.get_prefix_keys(requests_prefix(client))}
    stale = sorted({k[len(base):].split("/", 1)[0] for k in client.get_prefix_keys(base)} - live)
    for rid in stale:
        client.delete_prefix(run_prefix(client, rid))
    return stale


def run_check(client: EtcdClient, hosts: list[str], *, nbytes: int, timeout_s: float, by: str = "") -> Report:
    """One cluster check across ``hosts``, through their agents.

    Args:
        client: etcd.
        hosts: the nodes, in rank order (``registered_hosts``).
        nbytes: the bandwidth all-reduce's size.
        timeout_s: the check's time limit (the probes' phases fit in it).
        by: who asks (``user@host``).

    Returns:
        The report once every host has a result, or at the time limit.

    Raises:
        ControlPlaneUnavailable: etcd went away.
    """
    sweep_runs(client)
    request = Request(id=new_request_id(), hosts=tuple(hosts), bytes=nbytes, timeout_s=timeout_s, by=by)
    lease = client.lease(int(timeout_s) + LEASE_MARGIN_S)
    try:
        client.put_json(request_key(client, request.id), request.to_dict(), lease=lease)
        log.info("cluster_check_requested", request=request.id, hosts=hosts)
        deadline = time.monotonic() + timeout_s + WAIT_MARGIN_S
        while True:
            # decide first, then read the report: read before the decision, it could miss the
            # results that arrived in between and name every host as silent
            if finished(client, request) or time.monotonic() >= deadline:
                return collect(client, request)
            time.sleep(POLL_S)
    finally:
        client.delete(request_key(client, request.id))
        client.delete_prefix(run_prefix(client, request.id))
        client.revoke_lease(lease)

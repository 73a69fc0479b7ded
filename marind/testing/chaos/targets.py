"""Finding targets through etcd and checking that a pid is what its record says.

Records (docs/design.md §2): ``{p}/jobs/{job}/nodes/{node}`` =
``{state, torchrun_pid, workers: [{rank, local_rank, pid}], restarts, step,
updated_at, host, agent_pid}`` and ``{p}/nodes/{node}`` =
``{node, host, slots, labels, version, started_at[, pid]}``.

Selection (``local_workers``, ``local_nodes``) is pure over plain dicts.
Validation (``worker_is_genuine``, ``agent_is_genuine``) asks the OS via
psutil: a worker must be alive and a descendant of its record's
``torchrun_pid``; an agent must be alive and older than its registration.
A pid that fails the check (exited, reused) is never signalled.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime

import psutil

from marind.core.etcd_client import EtcdClient

# A record's start time and the OS's process create time come from two clocks' readings;
# allow this much skew before calling a process "younger than its record".
CLOCK_SLACK_S = 2.0


@dataclass(frozen=True)
class Worker:
    """A worker of the job, as its node's record places it."""

    node: str
    rank: int
    local_rank: int | None
    pid: int
    torchrun_pid: int | None


@dataclass(frozen=True)
class NodeTarget:
    """A node of the job on this host: its agent, torchrun and workers' pids."""

    node: str
    agent_pid: int | None
    torchrun_pid: int | None
    worker_pids: tuple[int, ...]
    started_at: float | None


def _last_part(key: str) -> str:
    return key.rstrip("/").rsplit("/", 1)[-1]


def job_node_records(client: EtcdClient, job: str) -> dict[str, dict]:
    """``{node: record}`` of the job's per-node records."""
    rows = client.get_prefix_json(client.key("jobs", job, "nodes") + "/")
    return {_last_part(k): v for k, v in rows.items() if isinstance(v, dict)}


def node_records(client: EtcdClient) -> dict[str, dict]:
    """``{node: record}`` of every registered node."""
    rows = client.get_prefix_json(client.key("nodes") + "/")
    return {_last_part(k): v for k, v in rows.items() if isinstance(v, dict)}


def this_host_names() -> frozenset[str]:
    """This host's names (hostname, FQDN and their short forms)."""
    names = {socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    names |= {n.split(".", 1)[0] for n in list(names)}
    return frozenset(n for n in names if n)


def record_host(job_rec: dict, node_rec: dict | None) -> str | None:
    """The host a job's node record (else its node registration) names."""
    return job_rec.get("host") or (node_rec or {}).get("host")


def is_local(job_rec: dict, node_rec: dict | None, hostnames: frozenset[str]) -> bool:
    """A record is ours only when it names this host (a record without a host is not)."""
    host = record_host(job_rec, node_rec)
    if not host:
        return False
    return host in hostnames or host.split(".", 1)[0] in hostnames


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def local_workers(job_nodes: dict[str, dict], nodes: dict[str, dict],
                  hostnames: frozenset[str]) -> list[Worker]:
    """Every worker the job's records place on this host, sorted by (rank, node, pid)."""
    out = []
    for node, rec in job_nodes.items():
        if not is_local(rec, nodes.get(node), hostnames):
            continue
        torchrun = _int(rec.get("torchrun_pid"))
        for w in rec.get("workers") or []:
            pid = _int(w.get("pid")) if isinstance(w, dict) else None
            rank = w.get("rank") if isinstance(w, dict) else None
            if pid is None or not isinstance(rank, int):
                continue
            out.append(Worker(node=node, rank=rank, local_rank=w.get("local_rank"),
                              pid=pid, torchrun_pid=torchrun))
    return sorted(out, key=lambda w: (w.rank, w.node, w.pid))


def parse_time(value) -> float | None:
    """Unix seconds from a number or an ISO-8601 string; None if neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def local_nodes(job_nodes: dict[str, dict], nodes: dict[str, dict],
                hostnames: frozenset[str]) -> list[NodeTarget]:
    """The job's nodes on this host, sorted by name."""
    out = []
    for node, rec in sorted(job_nodes.items()):
        node_rec = nodes.get(node) or {}
        if not is_local(rec, node_rec, hostnames):
            continue
        workers = tuple(p for p in (_int(w.get("pid")) for w in rec.get("workers") or []
                                    if isinstance(w, dict)) if p)
        out.append(NodeTarget(node=node, agent_pid=_int(rec.get("agent_pid")) or _int(node_rec.get("pid")),
                              torchrun_pid=_int(rec.get("torchrun_pid")), worker_pids=workers,
                              started_at=parse_time(node_rec.get("started_at"))))
    return out


def find_workers(client: EtcdClient, job: str, *, rank: int | None = None, node: str | None = None,
                 exclude: frozenset[int] | set[int] = frozenset()) -> list[Worker]:
    """The job's genuine live workers on this host, optionally one rank / one node's."""
    workers = local_workers(job_node_records(client, job), node_records(client), this_host_names())
    workers = [w for w in workers if w.pid not in exclude
               and (rank is None or w.rank == rank) and (node is None or w.node == node)]
    return [w for w in workers if worker_is_genuine(w)]


# -- checks against the OS ------------------------------------------------------------------------
def live_process(pid: int | None) -> psutil.Process | None:
    """The process if it exists and is not a zombie."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_descendant(proc: psutil.Process, ancestor_pid: int) -> bool:
    """Whether ``ancestor_pid`` is among ``proc``'s parents."""
    try:
        return any(p.pid == ancestor_pid for p in proc.parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def worker_is_genuine(worker: Worker) -> bool:
    """Alive, and a descendant of the torchrun its record names (so not a reused pid)."""
    proc = live_process(worker.pid)
    if proc is None or worker.torchrun_pid is None:
        return False
    if live_process(worker.torchrun_pid) is None:
        return False
    return is_descendant(proc, worker.torchrun_pid)


def agent_is_genuine(target: NodeTarget) -> bool:
    """Alive; started no later than it registered; the parent of the record's torchrun if any."""
    proc = live_process(target.agent_pid)
    if proc is None:
        return False
    try:
        created = proc.create_time()
    except psutil.Error:
        return False
    if target.started_at is not None and created > target.started_at + CLOCK_SLACK_S:
        return False
    torchrun = live_process(target.torchrun_pid)
    if torchrun is not None and not is_descendant(torchrun, proc.pid):
        return False
    if target.started_at is None and torchrun is None:
        return False  # nothing to check the pid against: refuse rather than guess
    return True

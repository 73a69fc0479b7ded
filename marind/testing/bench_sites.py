"""Where the goodput benchmark's job runs and how a fault reaches it: this machine, or the multi-host bed.

``bench/goodput.py`` (and its helpers) run their job on a *site*:

* ``LoopbackSite``: the agents on this machine (``marind.testing.cluster``),
  faults by ``chaos/kill_random_rank.py``; only ``kill``.
* ``BedSite``: one agent per host of a ``marind.testing.hosts.HostBed``
  (own hostname, control and data networks; etcd on the bed). ``kill`` is
  ``chaos/kill_random_rank.py`` run inside a seeded host (where the job's
  records name that host); ``power_off`` is the silent loss of the host
  holding global rank 0 (and the workers' store): both its links cut and
  its processes SIGSTOPped at once (``marind.testing.chaos.host_faults``).
  After ``back_after`` seconds the host reboots: its processes are gone
  (SIGKILL), its links back, its agent started again; the job grows back
  at its next round.

``inject`` returns what the recovery watch needs: the nodes that survive
the fault (their workers at the fault must exit: detection) and the world
size the recovered job has.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from marind.core.etcd_client import EtcdClient
from marind.testing.chaos import host_faults
from marind.testing.cluster import REPO, env, start_nodes, stop_agent

FAULTS = ("kill", "power_off")


@dataclass(frozen=True)
class Injected:
    """A fault as the recovery watch sees it."""

    kind: str
    survivors: tuple[str, ...]     # nodes whose workers at the fault must exit (detection)
    world: int                     # ranks of the recovered world
    host: str | None = None        # the host powered off
    victim: str | None = None      # the node whose worker was killed (bed kills)


def kill_line(res: subprocess.CompletedProcess) -> dict:
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"kill_random_rank found no worker: {res.stderr.strip()[-400:]}")
    return lines[0]


def kill_cmd(job_id: str, etcd: str, prefix: str, seed: int, node: str | None = None) -> list[str]:
    return [sys.executable, str(REPO / "chaos" / "kill_random_rank.py"), "--job", job_id, "--etcd", etcd,
            "--prefix", prefix, "--seed", str(seed), "--wait", "30", *(["--node", node] if node else [])]


def rank0_node(nodes: list[str], run_dirs: list[Path]) -> str:
    """The node whose run directory has the freshest progress record of global rank 0."""
    best, best_at = nodes[0], -1.0
    for node, run_dir in zip(nodes, run_dirs):
        try:
            at = float(json.loads((run_dir / "progress" / "rank-0.json").read_text()).get("updated_at") or 0)
        except (OSError, ValueError):
            continue
        if at > best_at:
            best, best_at = node, at
    return best


class LoopbackSite:
    """Agents as processes of this machine; etcd given."""

    name = "loopback"

    def __init__(self, root: Path, endpoint: str):
        self.root, self.endpoint = root, endpoint

    def node_names(self, run: str, nodes: int) -> list[str]:
        return [f"{run}-{i}" for i in range(nodes)]

    def start(self, names: list[str], prefix: str) -> dict:
        return dict(zip(names, start_nodes(self.root, names, self.endpoint, prefix)))

    def stop(self, agents: dict) -> None:
        for agent in agents.values():
            stop_agent(agent)

    def inject(self, kind: str, job, prefix: str, seed: int, agents: dict) -> Injected:
        if kind != "kill":
            raise ValueError(f"--fault {kind} needs the multi-host bed (root and ip netns)")
        kill_line(subprocess.run(kill_cmd(job.id, self.endpoint, prefix, seed), env=env(), capture_output=True,
                                  text=True, timeout=60, cwd=REPO))
        return Injected(kind, tuple(job.nodes), job.world)

    def settle(self, injected: Injected, at: float, prefix: str, agents: dict) -> None:
        """Nothing to bring back after a kill."""


class BedSite:
    """One agent per host of a started ``HostBed`` (etcd on its control network)."""

    name = "bed"

    def __init__(self, bed, back_after: float):
        self.bed, self.back_after = bed, back_after
        self.root, self.endpoint = bed.root, bed.plan.etcd
        self._frozen: dict[str, list] = {}

    def node_names(self, run: str, nodes: int) -> list[str]:
        if nodes > len(self.bed.names):
            raise ValueError(f"--nodes {nodes}: the bed has {len(self.bed.names)} hosts")
        return self.bed.names[:nodes]

    def _start_one(self, host: str, prefix: str):
        return self.bed.start_agent(host, prefix, env={"MARIND_LOG_JSON": "1", "OMP_NUM_THREADS": "1"})

    def start(self, names: list[str], prefix: str) -> dict:
        agents: dict = {}
        try:                            # the caller can stop only what it was given back
            for n in names:
                agents[n] = self._start_one(n, prefix)
            self._wait_registered(names, prefix)
        except BaseException:
            for agent in agents.values():
                stop_agent(agent)
            raise
        return agents

    def _wait_registered(self, names: list[str], prefix: str, timeout: float = 60.0) -> None:
        with EtcdClient(self.endpoint, prefix=prefix) as client:
            deadline = time.time() + timeout
            while not all(client.get_json(client.key("nodes", n)) for n in names):
                if time.time() > deadline:
                    raise RuntimeError(f"the bed's agents did not register within {timeout:.0f} s")
                time.sleep(0.2)

    def stop(self, agents: dict) -> None:
        for host, frozen in self._frozen.items():
            self.bed.power_on(host, frozen)
        self._frozen.clear()
        for agent in agents.values():
            stop_agent(agent)

    def inject(self, kind: str, job, prefix: str, seed: int, agents: dict) -> Injected:
        if kind == "kill":
            host = random.Random(seed).choice(job.nodes)
            line = kill_line(self.bed.run(host, kill_cmd(job.id, self.endpoint, prefix, seed, node=host),
                                          env={"MARIND_LOG_JSON": "1"}, timeout=60))
            return Injected(kind, tuple(job.nodes), job.world, victim=str(line.get("node") or host))
        if kind != "power_off":
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULTS)}")
        host = rank0_node(job.nodes, job.run_dirs())
        self._frozen[host] = self.bed.power_off(host)
        survivors = tuple(n for n in job.nodes if n != host)
        return Injected(kind, survivors, job.world // len(job.nodes) * len(survivors), host)

    def settle(self, injected: Injected, at: float, prefix: str, agents: dict) -> None:
        """A powered-off host reboots ``back_after`` s after the fault: processes gone, links and agent back."""
        if injected.kind != "power_off" or injected.host is None:
            return
        time.sleep(max(0.0, at + self.back_after - time.time()))
        host = injected.host
        self._frozen.pop(host, None)
        host_faults.kill_host_processes(self.bed.host(host))
        self.bed.restore(host, "both")
        agents[host] = self._start_one(host, prefix)
        self._wait_registered([host], prefix)

"""torchft jobs on this node: replica-group slot, lighthouse election, what the workers see.

Under ``[fault] mode = "torchft"`` every node runs its own torchrun (one
replica group) and all groups of a job meet at one torchft lighthouse.
``FTCoordinator.tick()`` (called by the agent's loop for each such job):

* claims a place in a replica group, ``{p}/jobs/{job}/ft/groups/{i}/{m}``
  (group 0 <= i < ``fault.replica_groups``, member 0 <= m <
  ``fault.nodes_per_group``; created only if absent, under the node's lease).
  It fills groups that already have members first, so that whole groups form;
  the members of group i run one torchrun rendezvous ``rg-{i}`` together;
* elects the lighthouse: the node that creates ``{p}/jobs/{job}/ft/lighthouse``
  (only if absent, under its lease) runs ``torchft_lighthouse`` and the key
  holds ``{node, address, pid}``. The key is written once, so its
  mod_revision is the lighthouse's **epoch**. When the holder dies its lease
  expires, the key goes, and the next agent to tick wins; a holder whose
  lighthouse process died deletes the key and runs for it again. A node that
  finds another's key stops any lighthouse of its own;
* publishes ``{address, epoch}`` to ``{run_dir}/ft/lighthouse.json`` (atomic
  rename) whenever it changes: the workers read it at start and when a quorum
  fails (trainer/ft.py), so they follow the lighthouse without a restart.

The lighthouse runs from torchft's Rust extension loaded by file path, so
neither the agent nor the lighthouse process imports torch.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from marind.control.ft_status import fault_settings, group_members
from marind.core import workerenv as WE
from marind.core.etcd_client import EtcdClient
from marind.core.lighthouse_file import LighthouseRecord, write_lighthouse
from marind.core.log import get_logger
from marind.core.netutil import free_port, port_open
from marind.core.progress import ProgressRecord, read_records
from marind.core.spec import FaultSpec, RunSpec

READY_TIMEOUT_S = 10.0

# PR_SET_PDEATHSIG (the lighthouse dies with its agent), then torchft's LighthouseServer from the
# extension module alone (importing the torchft package would import torch). Its CLI main reads the
# process's own argv, hence the server class. argv: SO BIND MIN_REPLICAS JOIN_MS HEARTBEAT_MS
_SERVE = (
    "import ctypes, importlib.util, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "except OSError:\n"
    "    pass\n"
    "spec = importlib.util.spec_from_file_location('torchft._torchft', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "server = mod.LighthouseServer(bind=sys.argv[2], min_replicas=int(sys.argv[3]), join_timeout_ms=int(sys.argv[4]),\n"
    "                              quorum_tick_ms=100, heartbeat_timeout_ms=int(sys.argv[5]))\n"
    "print('lighthouse', server.address(), flush=True)\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "while True:\n"
    "    signal.pause()\n"
)


def extension_path() -> str:
    """Path of torchft's compiled extension; ImportError if torchft is not installed."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchft is not installed: pip install 'marind[torchft]' (or: pip install torchft)")
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "_torchft*.so"))
    if not found:
        raise ImportError(f"torchft's extension _torchft*.so is missing under {spec.submodule_search_locations[0]}")
    return found[0]


class LighthouseProcess:
    """One ``torchft_lighthouse`` child of this agent."""

    def __init__(self, fault: FaultSpec | Mapping, log_path: Path, host: str):
        self.fault = fault if isinstance(fault, FaultSpec) else FaultSpec(**dict(fault))
        self.log_path, self.host = log_path, host
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """The lighthouse's URL."""
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        """Is the process running?"""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the lighthouse on a free port and wait until it listens.

        Raises:
            ImportError: torchft is not installed.
            RuntimeError: it did not listen within ``READY_TIMEOUT_S`` (the log says why).
        """
        f = self.fault
        self.port = free_port()
        args = [sys.executable, "-c", _SERVE, extension_path(), f"0.0.0.0:{self.port}",
                str(f.min_replicas), str(int(f.join_timeout * 1000)), str(int(f.heartbeat_timeout * 1000))]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"torchft lighthouse did not start listening on port {self.port}; "
                                   f"see {self.log_path}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 3 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3)
        self.proc = None


class FTCoordinator:
    """Slot, election and published address of one torchft job on this node.

    Args:
        client: the etcd client.
        job: the job's id.
        node: this node's name.
        host: this node's address (where its lighthouse listens).
        spec: the job's spec (see ``fault_settings`` for the mapping form).
        run_dir: the job's run dir on this node.
        lease: the node's current etcd lease (slot and lighthouse keys live under it).
    """

    def __init__(self, client: EtcdClient, job: str, node: str, host: str, spec: RunSpec | Mapping,
                 run_dir: Path, lease: Callable[[], object]):
        self.client, self.job, self.node, self.host = client, job, node, host
        self.fault = fault_settings(spec)
        self.groups = self.fault.replica_groups
        self.per_group = self.fault.nodes_per_group
        self.run_dir = Path(run_dir)
        self._lease = lease
        self.slot: int | None = None             # our replica group
        self.member: int | None = None           # our place in it
        self.launched_slot: int | None = None    # the group our running torchrun belongs to (daemon)
        self.lighthouse: dict | None = None      # {node, address, pid, epoch} as last read
        self.proc: LighthouseProcess | None = None
        self.published: tuple[str, int] | None = None
        self.elections_won = 0
        self.log = get_logger(__name__, node=node, job=job)

    def key(self, *parts: str) -> str:
        """A key under ``{p}/jobs/{job}/ft/``."""
        return self.client.key("jobs", self.job, "ft", *parts)

    @property
    def ready(self) -> bool:
        """A slot and a lighthouse address: torchrun may start."""
        return self.slot is not None and self.published is not None

    @property
    def holds_lighthouse(self) -> bool:
        """Does this node run the elected lighthouse?"""
        return bool(self.lighthouse and self.lighthouse.get("node") == self.node and self.proc and self.proc.alive())

    def worker_env(self) -> dict[str, str]:
        """What the workers learn of their group and lighthouse (``marind.core.workerenv``)."""
        address, _ = self.published or ("", 0)
        return {WE.REPLICA_GROUP: str(self.slot), WE.TORCHFT_LIGHTHOUSE: address}

    # -- one tick -------------------------------------------------------------------------
    def tick(self) -> None:
        """Claim, elect, publish (raises ControlPlaneUnavailable when etcd is away)."""
        self._claim_slot()
        self._elect()
        self._publish()

    def _claim_slot(self) -> None:
        held = group_members(self.client.get_prefix_json(self.key("groups") + "/"))
        mine = sorted((i, m) for i, members in held.items() for m, node in members.items() if node == self.node)
        if mine:
            self.slot, self.member = mine[0]
            return
        if self.slot is not None:
            self.log.warning("ft_slot_lost", slot=self.slot, member=self.member,
                             reason="the node's lease changed or expired")
        record = json.dumps({"node": self.node, "at": time.time()})
        for i, m in claim_order(held, self.groups, self.per_group, prefer=self.slot):
            if self.client.create(self.key("groups", str(i), str(m)), record, lease=self._lease()):
                self.slot, self.member = i, m
                self.log.info("ft_slot_claimed", slot=i, member=m)
                return
        self.slot = self.member = None

    def _read_lighthouse(self) -> dict | None:
        value, rev = self.client.get(self.key("lighthouse"))
        if value is None:
            return None
        try:
            rec = json.loads(value)
        except ValueError:
            return None
        return dict(rec, epoch=rev)

    def _elect(self) -> None:
        current = self._read_lighthouse()
        if current is not None and current.get("node") == self.node and not (self.proc and self.proc.alive()):
            # ours, but the process is gone (it died, or a previous agent of this node ran it)
            self.log.warning("ft_lighthouse_lost", epoch=current["epoch"], action="re-elect")
            self.client.delete(self.key("lighthouse"))
            current = None
        if current is None:
            current = self._run_for_lighthouse()
        if current is not None and current.get("node") != self.node and self.proc is not None:
            self.log.info("ft_lighthouse_yield", holder=current.get("node"))
            self.proc.stop()
            self.proc = None
        self.lighthouse = current

    def drop_silent_holder(self, node: str) -> bool:
        """The lighthouse's holder ``node`` went silent on both networks (``marind.agent.liveness.silence``):
        delete its key (if it still names that node, same epoch) so that the next tick of a node
        that reaches etcd elects a lighthouse the connected groups reach, without waiting for the
        holder's lease to expire. A holder that comes back finds another's key and stops its own.

        Returns:
            Whether the key was deleted. Raises ControlPlaneUnavailable.
        """
        current = self._read_lighthouse()
        if current is None or current.get("node") != node:
            return False
        dropped = self.client.delete_if(self.key("lighthouse"), int(current["epoch"]))
        if dropped:
            self.log.warning("ft_lighthouse_dropped", holder=node, epoch=current["epoch"],
                             reason="its host is silent on both networks")
        return dropped

    def _run_for_lighthouse(self) -> dict | None:
        if not (self.proc and self.proc.alive()):
            self.proc = LighthouseProcess(self.fault, self.run_dir / "logs" / "lighthouse.log", self.host)
            self.proc.start()
        proc = self.proc.proc
        assert proc is not None     # start() returned: the process runs
        record = {"node": self.node, "address": self.proc.address, "pid": proc.pid, "at": time.time()}
        if self.client.create(self.key("lighthouse"), json.dumps(record), lease=self._lease()):
            self.elections_won += 1
            current = self._read_lighthouse()
            self.log.info("ft_lighthouse_elected", address=self.proc.address,
                          epoch=current["epoch"] if current else None)
            return current
        return self._read_lighthouse()

    def _publish(self) -> None:
        lh = self.lighthouse
        if not lh or not lh.get("address"):
            return
        now = (str(lh["address"]), int(lh["epoch"]))
        if now == self.published:
            return
        write_lighthouse(self.run_dir, LighthouseRecord(address=now[0], epoch=now[1], node=lh.get("node")))
        self.log.info("ft_lighthouse_published", address=now[0], epoch=now[1], holder=lh.get("node"))
        self.published = now

    # -- reporting / end ------------------------------------------------------------------
    def report(self) -> dict:
        """Fields for this node's job record: its group and what its workers last saw of the quorum."""
        newest: ProgressRecord | None = None       # the newest of this node's ranks' records
        for rec in read_records(self.run_dir):
            if newest is None or rec.updated_at >= newest.updated_at:
                newest = rec
        return {"replica_group": self.slot, "member": self.member, "lighthouse": self.holds_lighthouse,
                "lighthouse_epoch": self.published[1] if self.published else None,
                "participants": newest.participants if newest else None,
                "quorum_id": newest.quorum_id if newest else None}

    def stop(self, release: bool = True) -> None:
        """Stop our lighthouse; with ``release``, give up our slot and the lighthouse key."""
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
        if not release:
            return
        try:
            if self.lighthouse and self.lighthouse.get("node") == self.node:
                self.client.delete(self.key("lighthouse"))
            if self.slot is not None:
                key = self.key("groups", str(self.slot), str(self.member))
                value, _ = self.client.get(key)
                if value and json.loads(value).get("node") == self.node:
                    self.client.delete(key)
        except Exception as exc:  # noqa: BLE001 - the keys go with our lease anyway
            self.log.warning("ft_release_failed", error=str(exc))


def claim_order(held: dict[int, dict[int, str]], groups: int, per_group: int,
                prefer: int | None = None) -> list[tuple[int, int]]:
    """Free (group, member) places, best first: ``prefer`` (the group we had), then groups with
    the most members already (so that groups complete rather than spread thin), lowest first."""
    def rank(i: int) -> tuple:
        return (i != prefer, -len(held.get(i, {})), i)
    return [(i, m) for i in sorted(range(groups), key=rank) for m in range(per_group)
            if m not in held.get(i, {})]

"""The memory tier of a training run: a ``CheckpointStore`` over the nodes' host memory.

``MemoryTier.open`` is collective (every rank calls it, once per world): the ranks
all-gather their hosts and data-network addresses, the lowest rank of each host starts
the host's transfer server (``server``) over the host's directory
(``{base}/{run}/{host}``, in a tmpfs: host memory that outlives the trainer's
processes, so a restarted world finds it), and they all-gather the servers' ports. The
tier's store then saves like any other (agreed step, every rank's part, rank 0's commit
under the lease fence) into ``peermem://`` storage (``peer_storage``): each part in
its node's memory and in the next node's.

``restorable`` says which memory step the current world can restore: the newest committed
one whose every object is on a live node (its own copy or its replica), with the reason
for each newer one it cannot (``ring.survives`` is the same answer from the placement alone).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

from ckpt_store import agreement
from ckpt_store.errors import CheckpointCorrupt, CheckpointError
from ckpt_store.format.manifest import read_manifest
from ckpt_store.format.steps import committed_steps, step_dir
from ckpt_store.log import get_logger
from ckpt_store.memory.ring import node_order
from ckpt_store.memory.server import start_server, stop_server
from ckpt_store.store import CheckpointStore

log = get_logger(__name__)
#: where host memory is, on Linux
DEFAULT_BASE = "/dev/shm/marind-ckpt"


@dataclass(frozen=True)
class MemoryStep:
    """What the memory tier holds of one committed step: ``complete`` when every object its
    manifest lists is on a live node; ``reason`` says what is missing otherwise."""

    step: int
    complete: bool
    reason: str


def advertised_addr() -> str:
    """This host's address on the network that reaches ``MASTER_ADDR`` (the data network):
    the source address the kernel picks for it (a UDP connect sends nothing); 127.0.0.1 alone."""
    master = os.environ.get("MASTER_ADDR")
    if not master or master in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MemoryTier:
    """A run's memory checkpoints (see the module docstring); build it with ``open``.

    Attributes:
        store: the ``CheckpointStore`` (``peermem://`` this host's directory).
        host_dir: this host's directory of memory checkpoints.
        nodes: the world's hosts in ring order; ``node``: this host's index.
    """

    def __init__(self, store: CheckpointStore, host_dir: str, nodes: list[str], node: int,
                 server: subprocess.Popen | None):
        self.store, self.host_dir, self.nodes, self.node = store, host_dir, nodes, node
        self._server = server

    @classmethod
    def open(cls, run: str, *, base: str = DEFAULT_BASE, host: str | None = None, keep_last: int = 1,
             fence_file: str | None = None, timeout_s: float = 30.0, commit_timeout_s: float = 120.0,
             writer: str = "auto", prepare_timeout_s: float | None = None) -> MemoryTier:
        """Open the run's memory tier on every rank (collective when a group is initialized).

        Args:
            run: the run's name under ``base`` (one directory per run and host).
            base: the directory of memory checkpoints on each host (a tmpfs).
            host: this host's name (default: the hostname).
            keep_last: committed memory steps kept (the older ones are deleted at each commit).
            fence_file: the lease file that fences commits (as ``CheckpointStore``'s).
            timeout_s: a peer silent this long fails the save or load that waits on it.
            commit_timeout_s: as ``CheckpointStore``'s.
            writer: as ``CheckpointStore``'s.
            prepare_timeout_s: as ``CheckpointStore``'s (a silent peer never stalls a step past it).

        Raises:
            ValueError: a bad ``run`` name.
            RuntimeError: this host's server did not start.
        """
        if not run or "/" in run or run.startswith("."):
            raise ValueError(f"memory tier run name {run!r}: use a plain directory name")
        host = host or socket.gethostname()
        me = {"host": host, "addr": advertised_addr()}
        multi = agreement.distributed()
        everyone = agreement.all_gather_json(me) if multi else [me]
        rank, _ = agreement.rank_world()
        hosts = node_order([e["host"] for e in everyone])
        leader = next(r for r, e in enumerate(everyone) if e["host"] == host) == rank
        host_dir = os.path.join(base, run, host)
        server, port = None, 0
        error = None
        if leader:
            try:
                server, port = start_server(host_dir)
            except (RuntimeError, OSError) as exc:
                error = str(exc)
        ports = agreement.all_gather_json({"port": port, "error": error}) if multi else [{"port": port,
                                                                                           "error": error}]
        failed = [p["error"] for p in ports if p["error"]]
        if failed:
            if server is not None:
                stop_server(server)
            raise RuntimeError(f"memory checkpoints: a host's transfer server did not start: {failed[0]}")
        addr_of = {e["host"]: e["addr"] for e in everyone}
        port_of = {everyone[r]["host"]: p["port"] for r, p in enumerate(ports) if p["port"]}
        nodes = [[addr_of[h], port_of[h]] for h in hosts]
        node = hosts.index(host)
        store = CheckpointStore(f"peermem://{host_dir}", {"nodes": nodes, "node": node, "timeout_s": timeout_s},
                                keep_last=keep_last, fence_file=fence_file, commit_timeout_s=commit_timeout_s,
                                writer=writer, direct_io=False, prepare_timeout_s=prepare_timeout_s)
        log.info("ckpt_memory_tier", host=host, node=node, nodes=hosts, dir=host_dir)
        return cls(store, host_dir, hosts, node, server)

    def restorable(self) -> list[MemoryStep]:
        """The committed memory steps, newest first, each complete on the live nodes or not (why).
        Reads alone (no collectives): the caller agrees (rank 0's answer, for one)."""
        out = []
        st = self.store.storage
        for s in reversed(committed_steps(st)):
            d = step_dir(s)
            try:
                objects = read_manifest(st, d)["objects"]
            except CheckpointCorrupt as exc:     # an object list missing: its host and replica lost
                out.append(MemoryStep(s, False, f"an object list is on no live node: {exc}"))
                continue
            except (CheckpointError, OSError) as exc:
                out.append(MemoryStep(s, False, f"manifest unreadable: {exc}"))
                continue
            held = st.object_sizes(d)
            missing = sorted(k for k, o in objects.items() if held.get(k) != o["size"])
            if missing:
                out.append(MemoryStep(s, False, f"{len(missing)} of {len(objects)} objects on no live node "
                                                f"(e.g. {missing[0]}): their host and its replica were lost"))
            else:
                out.append(MemoryStep(s, True, f"all {len(objects)} objects on live nodes"))
        return out

    def agreed_restorable(self) -> list[MemoryStep]:
        """``restorable`` as rank 0 found it, on every rank (one all-gather)."""
        rank, _ = agreement.rank_world()
        mine = [[m.step, m.complete, m.reason] for m in self.restorable()] if rank == 0 else []
        got: list[list] = agreement.all_gather_json(mine)[0] if agreement.distributed() else mine
        return [MemoryStep(int(row[0]), bool(row[1]), str(row[2])) for row in got]

    def close(self, clear: bool = False) -> None:
        """Close the store and stop this host's server; ``clear``: also delete this host's
        memory checkpoints (a run that ended: nothing will restore them)."""
        try:
            self.store.close()
        finally:
            if self._server is not None:
                stop_server(self._server)
                self._server = None
            if clear:
                shutil.rmtree(self.host_dir, ignore_errors=True)

"""A real etcd cluster of 3 (or 5) members on this machine, for tests and benches.

Production etcd is a cluster whose leader moves and whose members go down for maintenance;
this starts one from the Debian ``etcd`` binary, every member a ``LocalEtcd`` on its own
ports (127.0.0.1 by default, or an address of a test host's namespace), and gives the
faults a test needs: SIGKILL the leader or any member, stop a member and start it again with
its data, stop a majority (no quorum) and bring it back. ``endpoints`` lists every member,
as agents and workers are given them.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from marind.control.local_etcd import LocalEtcd
from marind.core.etcd_members import MemberStatus, cluster_status, leader_endpoint
from marind.core.log import get_logger
from marind.core.netutil import free_ports

log = get_logger(__name__)


class EtcdCluster:
    """``size`` etcd members forming one cluster; started with ``start()``, ended with ``stop()``."""

    def __init__(self, root: str | os.PathLike, size: int = 3, host: str = "127.0.0.1"):
        if size < 1:
            raise ValueError("an etcd cluster needs at least one member")
        self.root = Path(root)
        self.host = host
        ports = free_ports(2 * size, host)
        names = [f"m{i}" for i in range(size)]
        peers = ",".join(f"{n}=http://{host}:{ports[2 * i + 1]}" for i, n in enumerate(names))
        token = f"marind-{uuid.uuid4().hex[:8]}"
        self.members = [
            LocalEtcd(self.root / n / "data", client_port=ports[2 * i], peer_port=ports[2 * i + 1], name=n,
                      host=host, initial_cluster=peers, cluster_token=token)
            for i, n in enumerate(names)]

    @property
    def endpoints(self) -> str:
        """Every member's client URL, comma-separated (what ``--etcd`` / ``MARIND_ETCD`` take)."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:
        """The same as ``endpoints`` (a drop-in for ``LocalEtcd.endpoint``)."""
        return self.endpoints

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member, then wait until each is healthy (a leader elected)."""
        for member in self.members:
            member.start(wait=False)
        deadline = time.monotonic() + timeout
        for member in self.members:
            member.wait_healthy(max(1.0, deadline - time.monotonic()))
        self.wait_for_leader(timeout=max(1.0, deadline - time.monotonic()))
        log.info("etcd_cluster_started", endpoints=self.endpoints)
        return self

    def status(self) -> list[MemberStatus]:
        return cluster_status(self.endpoints, timeout=1.0)

    def leader(self) -> int | None:
        """The index of the member the running members agree leads; None without one."""
        endpoint = leader_endpoint(self.status())
        return next((i for i, m in enumerate(self.members) if m.endpoint == endpoint), None)

    def wait_for_leader(self, timeout: float = 30.0, other_than: int | None = None) -> int:
        """Until the running members agree on a leader (one not ``other_than``); its index."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            index = self.leader()
            if index is not None and index != other_than:
                return index
            time.sleep(0.1)
        raise TimeoutError(f"no etcd leader within {timeout}s among {self.endpoints}")

    def kill(self, index: int) -> None:
        """SIGKILL one member, as a crash would (its data stays)."""
        log.info("etcd_member_killed", member=self.members[index].name)
        self.members[index].kill()

    def kill_leader(self) -> int:
        """SIGKILL the current leader; its index."""
        index = self.wait_for_leader()
        self.kill(index)
        return index

    def stop_member(self, index: int) -> None:
        """Stop one member cleanly (SIGTERM), as for maintenance; its data stays."""
        self.members[index].stop()

    def start_member(self, index: int, timeout: float = 30.0) -> None:
        """Start a stopped member again with its data; it rejoins the cluster."""
        member = self.members[index]
        member.start(wait=False)
        if sum(m.running for m in self.members) * 2 > len(self.members):
            member.wait_healthy(timeout)

    def restore(self) -> None:
        """Start every member a test stopped or killed, and wait for a leader (a test's cleanup)."""
        for i, member in enumerate(self.members):
            if not member.running:
                self.start_member(i)
        self.wait_for_leader()

    def stop(self) -> None:
        """Stop every member (their data stays under ``root``)."""
        for member in self.members:
            try:
                member.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others whatever one did
                log.warning("etcd_member_stop_failed", member=member.name, error=str(exc))

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

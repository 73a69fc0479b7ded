"""Is the data network there? One agent's TCP probes of its job peers' data addresses.

Every agent listens on a TCP port of every address (``DataProber.start``) and
publishes its **data address** with that port in its row of each job
(``{p}/jobs/{job}/reach/{node}``, ``reach_rows``, docs/design.md §2): the address its hostname resolves to, the one torch's
default ``local_addr`` gives the workers' store and the one gloo's sockets use
on a host whose hostname resolves to its data network (the host bed does so,
``marind.testing.hosts``), with the listener's **token**. A background thread
connects to each peer's endpoint every ``PROBE_S`` and reads the greeting its
listener writes (``probe_handshake``: connect and greeting within
``CONNECT_TIMEOUT_S``, the peers in parallel), and keeps, per peer, when it last
answered and since when it has not (``PeerState``). Only the greeting with the
peer's token counts as reached: a cut link answers nothing (no RST) and the
probe times out; a REJECT rule, a closed port or another program on the port
answer, but not with the greeting. The listener's thread writes the greeting
at once, so a busy agent still answers. A peer answers **steadily** once it
answered every probe for ``STEADY_S`` (``PeerState.flaky_since`` clears only
then): over a lossy link, probes fail and answer by turns, and one answer
says little about whether the workers' collectives can get through.

``link_up`` says whether the interface that holds the data address has its
carrier (``IFF_RUNNING``): a host whose own data link is down is the one cut
off when two hosts cannot tell each other apart (``data_decisions``).

Nothing here touches etcd; ``data_watch`` publishes and decides.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil

from marind.agent.liveness.probe_handshake import new_token, probe_peer, reached, send_greeting
from marind.core.log import get_logger
from marind.doctor_cluster.probe import own_address

#: seconds between two probes of a peer
PROBE_S = 1.0
#: a connect and greeting that take longer count as unreachable
CONNECT_TIMEOUT_S = 1.0
#: a peer that answered every probe for this long answers **steadily** (three probes in a row at ``PROBE_S``)
STEADY_S = 2.0


#: a peer's published data endpoint: (addr, port, token; None from an agent that publishes none)
Endpoint = tuple[str, int, str | None]


@dataclass(frozen=True)
class PeerState:
    """What the probes of one peer found so far."""

    ok_at: float | None          # the last connect that succeeded (None: never)
    down_since: float | None     # the first failed probe since the last success (None: it answers)
    checked_at: float            # the last probe
    outcome: str                 # its outcome (``"ok"``, ``"timeout"``, ``"refused"``, ``"not_a_probe"``, ...)
    up_since: float | None = None      # the first answer of the answers in a row up to now (None: the last failed)
    flaky_since: float | None = None   # the first failed probe since it last answered steadily (None: steady)

    def steady_for(self, now: float) -> float:
        """How long it has answered every probe (0 when the last one failed)."""
        return 0.0 if self.up_since is None else now - self.up_since


def data_address() -> str:
    """This host's data address: what its hostname resolves to (torch's default ``local_addr``)."""
    return own_address()[1]


def link_up(addr: str) -> bool:
    """Has the interface holding ``addr`` its carrier? True when no interface holds it (cannot tell).

    Args:
        addr: an address of this host.

    Returns:
        False only when the interface is known and not running (admin down or no carrier).
    """
    try:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
                stats = psutil.net_if_stats().get(name)
                return True if stats is None else bool(stats.isup)
    except OSError:
        pass
    return True


class DataProber:
    """The agent's data-network listener and its probes of the peers' listeners.

    Args:
        addr: the data address to publish (default: ``data_address()``).
        probe_s: seconds between probe rounds.
        timeout_s: a connect's timeout.
    """

    def __init__(self, addr: str | None = None, *, probe_s: float = PROBE_S, timeout_s: float = CONNECT_TIMEOUT_S):
        self.addr = addr or data_address()
        self.probe_s, self.timeout_s = probe_s, timeout_s
        self.port = 0
        self.token = new_token()
        self._wanted: dict[str, dict[str, Endpoint]] = {}            # job -> peer -> endpoint
        self._states: dict[tuple[str, str, int, str | None], PeerState] = {}   # (peer, addr, port, token) -> state
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.log = get_logger(__name__)

    def start(self) -> DataProber:
        """Listen (every address, a free port) and start probing."""
        self._listener = socket.create_server(("0.0.0.0", 0), backlog=128)
        self.port = self._listener.getsockname()[1]
        for target in (self._serve, self._probe_loop):
            t = threading.Thread(target=target, name=f"data-probe-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        self.log.info("data_probe_listening", addr=self.addr, port=self.port)
        return self

    def stop(self) -> None:
        """Stop probing and close the listener."""
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    def endpoint(self) -> dict:
        """This node's data endpoint as published: ``{addr, port, token, link_up}``."""
        return {"addr": self.addr, "port": self.port, "token": self.token, "link_up": link_up(self.addr)}

    def want(self, job: str, peers: dict[str, Endpoint]) -> None:
        """Probe ``peers`` (node -> (addr, port, token or None)) for ``job`` from now on (replaces the job's set)."""
        with self._lock:
            self._wanted[job] = dict(peers)

    def jobs(self) -> list[str]:
        """The jobs probed for."""
        with self._lock:
            return list(self._wanted)

    def drop(self, job: str) -> None:
        """Stop probing for ``job``."""
        with self._lock:
            self._wanted.pop(job, None)

    def states(self, job: str) -> dict[str, PeerState]:
        """The probe state of each peer wanted for ``job`` (peers not probed yet are left out)."""
        with self._lock:
            wanted = self._wanted.get(job, {})
            return {peer: self._states[(peer, *ep)] for peer, ep in wanted.items() if (peer, *ep) in self._states}

    def _serve(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            send_greeting(conn, self.token)

    def _probe_loop(self) -> None:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="data-probe") as pool:
            while not self._stop.is_set():
                started = time.monotonic()
                with self._lock:
                    targets = {(peer, *ep) for peers in self._wanted.values() for peer, ep in peers.items()}
                    self._states = {k: v for k, v in self._states.items() if k in targets}
                outcomes = dict(zip(targets, pool.map(self._connect, targets), strict=True))
                now = time.time()
                with self._lock:
                    for target, outcome in outcomes.items():
                        self._states[target] = self._next(self._states.get(target), outcome, now)
                self._stop.wait(max(0.0, self.probe_s - (time.monotonic() - started)))

    def _connect(self, target: tuple[str, str, int, str | None]) -> str:
        return probe_peer(target[1], target[2], target[3], self.timeout_s)

    @staticmethod
    def _next(prev: PeerState | None, outcome: str, now: float) -> PeerState:
        """The state after a probe: ``down_since`` clears on one answer, ``flaky_since`` only once the
        answers come ``STEADY_S`` in a row (a lossy link, whose probes fail and answer by turns, stays flaky)."""
        if reached(outcome):
            up = prev.up_since if prev is not None and prev.up_since is not None else now
            flaky = None if prev is None or now - up >= STEADY_S else prev.flaky_since
            return PeerState(ok_at=now, down_since=None, checked_at=now, outcome=outcome, up_since=up,
                             flaky_since=flaky)
        since = prev.down_since if prev is not None and prev.down_since is not None else now
        flaky_since = prev.flaky_since if prev is not None and prev.flaky_since is not None else now
        return PeerState(ok_at=prev.ok_at if prev else None, down_since=since, checked_at=now, outcome=outcome,
                         flaky_since=flaky_since)

"""Faults a whole host suffers on the multi-host bed: power loss and network partitions.

The library of ``chaos/power_off.py`` and ``chaos/partition.py``. A host is
found in a bed's state file (``--bed DIR`` or ``MARIND_BED``, written by
``marind.testing.hosts.HostBed``); its processes are those in its network
namespace (the bed's holder process excepted: it is the machine, not a
process on it); its links are the outer veth ends of its two networks.
Output and exit codes follow the other injectors (``common``): one JSON
line per action, 0 acted, 1 nothing to act on (no bed, no such host).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from dataclasses import dataclass

import psutil

from marind.core.log import get_logger
from marind.testing import hosts_net as net
from marind.testing.chaos.common import NothingToDo, emit
from marind.testing.hosts_plan import BED_ENV, NETS, BedPlan, HostPlan, read_state

log = get_logger("chaos.host_faults")


@dataclass(frozen=True)
class Frozen:
    """A process stopped by ``freeze``: its pid and start time (a resumed pid must be the same process)."""

    pid: int
    create_time: float


def add_bed_args(parser: argparse.ArgumentParser) -> None:
    """``--bed``, ``--host`` and ``--seed``: which bed, which host of it."""
    parser.add_argument("--bed", help=f"the bed's directory or state file (default ${BED_ENV})")
    parser.add_argument("--host", help="the host (default: a seeded choice among the bed's hosts)")
    parser.add_argument("--seed", type=int, help="seed of the host choice (default: drawn, and printed)")


def load_bed(location: str | None) -> BedPlan:
    """The bed at ``--bed`` or ``MARIND_BED``.

    Raises:
        ValueError: neither is given, or the file is not a bed state file.
        NothingToDo: no bed there (never built, or torn down).
    """
    location = location or os.environ.get(BED_ENV)
    if not location:
        raise ValueError(f"no bed: pass --bed DIR or set {BED_ENV} (the bed's directory)")
    try:
        return read_state(location)
    except FileNotFoundError:
        raise NothingToDo(f"no bed state at {location} (the bed is not running)") from None


def pick_host(plan: BedPlan, name: str | None, args: argparse.Namespace) -> HostPlan:
    """``--host`` or a seeded choice; the host must still be alive (its holder and namespace).

    Raises:
        NothingToDo: no such host, or it is gone.
    """
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "big")
    if name is None:
        host = random.Random(args.seed).choice(plan.hosts)
    else:
        try:
            host = plan.host(name)
        except KeyError as exc:
            raise NothingToDo(str(exc.args[0])) from None
    if not net.netns_exists(host.netns):
        raise NothingToDo(f"host {host.name} of bed {plan.bed_id} is gone (no namespace {host.netns})")
    return host


def host_processes(host: HostPlan) -> list[int]:
    """The host's processes: everything in its network namespace but the bed's holder and this one."""
    return [p for p in net.pids_in_netns(host.netns) if p not in (host.holder_pid, os.getpid())]


def freeze(host: HostPlan, rounds: int = 20) -> list[Frozen]:
    """SIGSTOP every process of ``host``, again until no new one appears (a fork in between)."""
    stopped: dict[int, Frozen] = {}
    for _ in range(rounds):
        new = [p for p in host_processes(host) if p not in stopped]
        if not new:
            break
        for pid in new:
            try:
                proc = psutil.Process(pid)
                created = proc.create_time()
                proc.send_signal(signal.SIGSTOP)
            except psutil.Error:
                continue
            stopped[pid] = Frozen(pid, created)
    _wait_stopped(list(stopped))
    return sorted(stopped.values(), key=lambda f: f.pid)


def _wait_stopped(pids: list[int], timeout: float = 2.0) -> None:
    """Wait until every pid is stopped or gone (a signal is taken when the process next runs)."""
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    pending.discard(pid)
            except psutil.Error:
                pending.discard(pid)
        if pending:
            time.sleep(0.01)
    if pending:
        log.warning("not_stopped_in_time", pids=sorted(pending))


def resume(frozen: list[Frozen]) -> list[int]:
    """SIGCONT each frozen process that is still the same process; the pids continued."""
    sent = []
    for f in frozen:
        try:
            proc = psutil.Process(f.pid)
            if proc.create_time() != f.create_time:
                continue
            proc.send_signal(signal.SIGCONT)
            sent.append(f.pid)
        except psutil.Error:
            continue
    return sent


def kill_host_processes(host: HostPlan, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of ``host`` (stopped ones too) until none is left; the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = host_processes(host)
        if not pids:
            break
        killed |= set(net.signal_pids(pids, signal.SIGKILL))
        time.sleep(0.05)
    return sorted(killed)


def veths(host: HostPlan, nets: list[str]) -> list[str]:
    """The outer veth ends of ``host``'s links to ``nets``."""
    return [host.link(n).veth for n in nets]


def interruptible_sleep(seconds: float) -> bool:
    """Sleep; SIGTERM/SIGINT end it early. Returns False when interrupted."""
    def _raise(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        time.sleep(seconds)
        return True
    except KeyboardInterrupt:
        log.info("interrupted_healing_early")
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)


def power_off(plan: BedPlan, host: HostPlan, *, forever: bool, back_after: float | None, seed: int) -> None:
    """Cut both links and SIGSTOP every process of ``host`` at once; then kill, resume, or leave it.

    One line ``power_off``; then ``kill`` (``forever``) or, after ``back_after`` seconds
    (or an interrupt), ``power_on`` (links restored first, then every process continued).
    """
    links = veths(host, list(NETS))
    net.set_links(links, up=False)
    frozen = freeze(host)
    emit("power_off", target=host.name, node=host.name, host=host.name, bed=plan.bed_id, links=links,
         stopped=[f.pid for f in frozen], signal="SIGSTOP", forever=forever, back_after=back_after, seed=seed)
    if forever:
        killed = kill_host_processes(host)
        emit("kill", target=host.name, node=host.name, host=host.name, bed=plan.bed_id, killed=killed,
             signal="SIGKILL", seed=seed)
        return
    if back_after is None:
        return
    try:
        interruptible_sleep(back_after)
    finally:
        net.set_links(links, up=True)
        resumed = resume(frozen)
        emit("power_on", target=host.name, node=host.name, host=host.name, bed=plan.bed_id, links=links,
             resumed=resumed, signal="SIGCONT", seed=seed)


def partition(plan: BedPlan, host: HostPlan, nets: list[str], seconds: float, seed: int,
              keep_carrier: bool = False) -> None:
    """Cut ``host``'s links to ``nets`` for ``seconds`` (or until interrupted), then heal.

    ``keep_carrier``: the bridge drops the host's frames instead, both link ends keeping their
    carrier (a switch dropping traffic). Two lines: ``partition`` and ``heal``.
    """
    links = veths(host, nets)
    if keep_carrier:
        net.set_forwarding(links, on=False)
    else:
        net.set_links(links, up=False)
    emit("partition", target=host.name, node=host.name, host=host.name, bed=plan.bed_id, nets=nets,
         links=links, seconds=seconds, carrier=keep_carrier, seed=seed)
    try:
        interruptible_sleep(seconds)
    finally:
        if keep_carrier:
            net.set_forwarding(links, on=True)
        else:
            net.set_links(links, up=True)
        emit("heal", target=host.name, node=host.name, host=host.name, bed=plan.bed_id, nets=nets,
             links=links, seed=seed)

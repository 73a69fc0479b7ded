"""Networks that half work on the test bed: nftables filters inside the hosts' own namespaces.

``HostBed.cut``/``drop`` take a host's link away whole. The filters here leave it up and
lose only some of its packets, the faults a flaky switch port or a one-way routing error
give:

* a **one-way drop** (``one_way``): host A's packets to host B on one network vanish, B's to
  A arrive. TCP needs both directions, so a connection either way fails (A's SYNs vanish;
  B's SYNs arrive, A's SYN-ACKs vanish); only one-way traffic (UDP) tells the directions apart;
* a **lossy link** (``lossy``): a share of a host's IPv4 packets on one network vanish, in
  both directions, each packet drawn alone (``numgen random mod 100 < P``).

Where they act: every rule drops at a **receiver's** ingress (a ``netdev`` ingress chain on
the host's inner interface), never at a sender's egress, so that, as on a wire, no sender's
stack learns that its packet was dropped (a drop in the sender's own output path returns
an error to the sending socket, which TCP takes for local congestion, not loss). A one-way
drop A->B is a rule in B's namespace (``ip saddr A drop``); a lossy link of host H is a rule
in H's namespace for what it receives and one in each other host's namespace for what H
sends them. Packets between a host and the bridge side (the bed's etcd and S3, in the root
namespace) are filtered on the host's side only: a lossy control link loses what the
servers send the host, not what it sends them.

Everything is in one table of the bed's own in each host's namespace (``netdev
marind_bed``), written whole and atomically (``ip netns exec NS nft -f -``: the old table
deleted and the new one made in one transaction) from what the bed holds
(``Filters``); nothing touches the root namespace or another table. A host without a filter
has no table. Healing deletes the tables; deleting the namespaces (``HostBed.close``, a
stale bed's sweep) takes them with it. Needs ``nft`` (Debian's ``nftables``, ``make setup``
installs it as root) and nf_tables in the kernel: ``nft_unavailable()`` says why not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from marind.core.log import get_logger
from marind.testing.hosts_net import BedError, add_netns, delete_netns
from marind.testing.hosts_plan import INNER_IFNAME, BedPlan, nets_of

log = get_logger("testing.hosts")

FAMILY = "netdev"
TABLE = "marind_bed"
#: before anything else sees the packet
PRIORITY = -500


@dataclass(frozen=True)
class Rule:
    """One drop rule in one host's table.

    Attributes:
        host: the host whose ingress drops (the receiver).
        ifname: the inner interface (``ctl0``/``data0``).
        saddr: only packets from this address (None: every IPv4 packet).
        percent: the share dropped, 1..100 (100: all).
        fault: the fault it belongs to (``Filters``' key, in the rule's comment).
    """

    host: str
    ifname: str
    saddr: str | None
    percent: int
    fault: str

    def render(self) -> str:
        match = f"ip saddr {self.saddr}" if self.saddr else "meta protocol ip"
        chance = "" if self.percent >= 100 else f" numgen random mod 100 < {self.percent}"
        return f'{match}{chance} drop comment "{self.fault}"'


def render_table(rules: list[Rule]) -> str:
    """The ``nft -f`` text that replaces one host's table with ``rules`` (all of one host; pure).

    Without rules it only deletes the table (``add`` first, so that a missing one is no error).
    """
    lines = [f"add table {FAMILY} {TABLE}", f"delete table {FAMILY} {TABLE}"]
    if not rules:
        return "\n".join(lines) + "\n"
    lines.append(f"table {FAMILY} {TABLE} {{")
    for ifname in sorted({r.ifname for r in rules}):
        lines.append(f"  chain in_{ifname} {{")
        lines.append(f'    type filter hook ingress device "{ifname}" priority {PRIORITY}; policy accept;')
        lines.extend(f"    {r.render()}" for r in rules if r.ifname == ifname)
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def check_percent(percent: float) -> int:
    """A loss share as ``numgen`` takes it: a whole number of percent, 1..100.

    Raises:
        ValueError: outside 1..100, or not whole.
    """
    if percent != int(percent) or not 1 <= percent <= 100:
        raise ValueError(f"loss must be a whole percentage in 1..100, not {percent!r}")
    return int(percent)


def one_way_rules(plan: BedPlan, src: str, dst: str, which: str) -> list[Rule]:
    """The rules of a one-way drop ``src`` -> ``dst`` on ``which`` (``control``, ``data`` or ``both``).

    Raises:
        KeyError: no such host.
        ValueError: ``src == dst`` or a bad network.
    """
    if src == dst:
        raise ValueError(f"a one-way drop needs two hosts, not {src} twice")
    sender = plan.host(src)
    plan.host(dst)
    return [Rule(host=dst, ifname=INNER_IFNAME[n], saddr=sender.link(n).addr, percent=100,
                 fault=f"one-way {src}->{dst} {n}") for n in nets_of(which)]


def lossy_rules(plan: BedPlan, name: str, which: str, percent: float) -> list[Rule]:
    """The rules of a lossy link of host ``name`` on ``which``: ``percent`` of its packets lost each way.

    Raises:
        KeyError: no such host.
        ValueError: a bad share or network.
    """
    pct = check_percent(percent)
    host = plan.host(name)
    out = []
    for n in nets_of(which):
        fault = f"lossy {name} {n} {pct}%"
        out.append(Rule(host=name, ifname=INNER_IFNAME[n], saddr=None, percent=pct, fault=fault))
        out += [Rule(host=h.name, ifname=INNER_IFNAME[n], saddr=host.link(n).addr, percent=pct, fault=fault)
                for h in plan.hosts if h.name != name]
    return out


class Filters:
    """The filters of one bed: fault -> its rules, and each host's table kept equal to them.

    Args:
        plan: the bed (its hosts' namespaces and addresses).
    """

    def __init__(self, plan: BedPlan):
        self.plan = plan
        self.faults: dict[str, list[Rule]] = {}

    def add(self, key: str, rules: list[Rule]) -> list[str]:
        """Add (or replace) fault ``key``; the hosts whose tables changed.

        Raises:
            BedError: ``nft`` is missing, or refused a table.
        """
        reason = nft_unavailable()
        if reason:
            raise BedError(reason)
        old = self.faults.get(key, [])
        self.faults[key] = rules
        hosts = sorted({r.host for r in [*old, *rules]})
        self._write(hosts)
        log.info("bed_filter", fault=key, hosts=hosts, rules=[r.render() for r in rules])
        return hosts

    def remove(self, involving: str | None = None) -> list[str]:
        """Remove the faults whose key names host ``involving`` (None: every fault); the faults removed.

        Raises:
            BedError: ``nft`` refused a table.
        """
        keys = [k for k in self.faults if involving is None or involving in _hosts_of_key(k)]
        hosts = sorted({r.host for k in keys for r in self.faults[k]})
        for k in keys:
            del self.faults[k]
        if hosts:
            self._write(hosts)
            log.info("bed_filter_healed", faults=keys, hosts=hosts)
        return keys

    def rules_of(self, host: str) -> list[Rule]:
        """Every rule in ``host``'s table now."""
        return [r for rules in self.faults.values() for r in rules if r.host == host]

    def _write(self, hosts: list[str]) -> None:
        for name in hosts:
            nft(self.plan.host(name).netns, render_table(self.rules_of(name)))


def fault_key(kind: str, *hosts: str, which: str) -> str:
    """The key of a fault (``one-way:host1>host2:data``, ``lossy:host1:data``)."""
    return f"{kind}:{'>'.join(hosts)}:{which}"


def _hosts_of_key(key: str) -> list[str]:
    return key.split(":")[1].split(">")


def nft(netns: str, text: str) -> None:
    """Load ``text`` with ``nft -f -`` in namespace ``netns`` (``ip netns exec``).

    Raises:
        BedError: nft failed (the message has its error and the text).
    """
    try:
        res = subprocess.run(["ip", "netns", "exec", netns, _nft_path(), "-f", "-"], input=text,
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise BedError(f"nft in {netns} did not finish within 30 s") from exc
    if res.returncode != 0:
        raise BedError(f"nft in {netns} failed: {res.stderr.strip()}\n{text}")


def list_table(netns: str) -> str:
    """The bed's table in ``netns`` as ``nft list`` prints it; empty when there is none."""
    res = subprocess.run(["ip", "netns", "exec", netns, _nft_path(), "list", "table", FAMILY, TABLE],
                         capture_output=True, text=True, timeout=30)
    return res.stdout if res.returncode == 0 else ""


def _nft_path() -> str:
    return shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin") or "nft"


@functools.lru_cache(maxsize=1)
def nft_unavailable() -> str | None:
    """Why the bed's filters cannot be used here (one line), or None when they can.

    Checks ``nft`` (on ``PATH`` or in ``/usr/sbin``) and that a ``netdev`` ingress chain loads in a
    scratch namespace of its own (the kernel's nf_tables; a container may forbid it). Assumes a
    bed can be built (``hosts_net.bed_unavailable``).
    """
    if shutil.which("nft") is None and shutil.which("nft", path="/usr/sbin:/sbin") is None:
        return "the bed's half-working networks need nft (Debian's nftables; `make setup` installs it as root)"
    probe = f"mb-nftprobe-{os.getpid()}"
    try:
        add_netns(probe)
        nft(probe, render_table([Rule(host="probe", ifname="lo", saddr="192.0.2.1", percent=50, fault="probe")]))
    except BedError as exc:
        return f"nftables does not work in a bed namespace here: {exc}".splitlines()[0]
    finally:
        delete_netns(probe)
    return None

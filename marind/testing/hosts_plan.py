"""What a multi-host test bed is made of: names, addresses, hosts files, and its state file.

Pure functions and frozen records, no processes and no system calls; the
bed (``marind.testing.hosts``) builds what ``plan_bed`` decides, and the
host faults (``marind.testing.chaos.host_faults``) read the state file it
writes. Naming (every interface name <= 15 characters, every name carries
the bed's id so that two beds never collide):

* network namespace of host H: ``mb-{id}-{H}``;
* bridges: ``mb{id}c`` (control) and ``mb{id}d`` (data);
* outer veth ends (on the bridges, in the root namespace): ``mb{id}c{i}`` /
  ``mb{id}d{i}``; inner ends (in the host): ``ctl0`` and ``data0``;
* addresses: control ``10.A.B.0/24`` and data ``10.A.B+1.0/24`` with A, B
  drawn per bed; the bridge side holds ``.1`` of each, host i ``.(10+i)``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONTROL = "control"
DATA = "data"
NETS = (CONTROL, DATA)
#: the interface names inside every host (the same in each: GLOO_SOCKET_IFNAME=data0 fits all)
INNER_IFNAME = {CONTROL: "ctl0", DATA: "data0"}
STATE_FILE = "bed.json"
#: the variable that points the chaos scripts at a bed's directory
BED_ENV = "MARIND_BED"
STATE_VERSION = 1
MAX_HOSTS = 200
_HOSTNAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_BED_ID = re.compile(r"^[0-9a-f]{6}$")


def nets_of(which: str) -> list[str]:
    """``control``, ``data`` or ``both`` -> the networks.

    Raises:
        ValueError: anything else.
    """
    if which == "both":
        return list(NETS)
    if which in NETS:
        return [which]
    raise ValueError(f"unknown network {which!r}: use control, data or both")


@dataclass(frozen=True)
class Link:
    """One host's link to one network.

    Attributes:
        net: ``control`` or ``data``.
        veth: the outer end, on the network's bridge in the root namespace (cut = set down).
        ifname: the inner end's name inside the host.
        addr: the host's address on that network.
    """

    net: str
    veth: str
    ifname: str
    addr: str


@dataclass(frozen=True)
class HostPlan:
    """One host: its hostname, namespace, links, and (once started) its holder process."""

    name: str
    netns: str
    control: Link
    data: Link
    holder_pid: int | None = None

    def link(self, net: str) -> Link:
        """The link to ``net`` (``control`` or ``data``)."""
        return self.control if net == CONTROL else self.data


@dataclass(frozen=True)
class BedPlan:
    """A whole bed: its id, its two networks, its hosts, and where its servers listen.

    Attributes:
        bed_id: six hex digits, in every name the bed creates.
        bridges: network -> bridge name.
        subnets: network -> ``10.A.B.0/24``.
        server_addrs: network -> the bridge side's address (etcd and S3 listen on the control one).
        hosts: the hosts, in order.
        etcd: the etcd endpoint once started (``http://ADDR:PORT``), else None.
        s3: the S3 endpoint once started, else None.
        owner_pid: the process that built the bed.
    """

    bed_id: str
    bridges: dict[str, str]
    subnets: dict[str, str]
    server_addrs: dict[str, str]
    hosts: tuple[HostPlan, ...]
    etcd: str | None = None
    s3: str | None = None
    owner_pid: int = field(default_factory=os.getpid)

    def host(self, name: str) -> HostPlan:
        """The host called ``name``.

        Raises:
            KeyError: no such host (the message lists the bed's hosts).
        """
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in bed {self.bed_id} (hosts: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        """The hostnames, in order."""
        return [h.name for h in self.hosts]


def new_bed_id(rng: random.Random | None = None) -> str:
    """Six random hex digits (``rng`` for tests; the OS's randomness otherwise)."""
    if rng is None:
        return os.urandom(3).hex()
    return f"{rng.randrange(1 << 24):06x}"


def check_names(names: list[str]) -> None:
    """Hostnames a bed can take: 1..200 of them, unique, ``[a-z][a-z0-9-]*`` up to 31 characters.

    Raises:
        ValueError: the first problem, with the fix.
    """
    if not 1 <= len(names) <= MAX_HOSTS:
        raise ValueError(f"a bed has 1 to {MAX_HOSTS} hosts, not {len(names)}")
    for name in names:
        if not _HOSTNAME.match(name):
            raise ValueError(f"bad hostname {name!r}: use lowercase letters, digits and '-', "
                             "starting with a letter, at most 31 characters")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate hostnames {dup}: give every host its own name")


def choose_subnets(rng: random.Random, taken: list[str]) -> tuple[str, str]:
    """Two adjacent free /24s in 10.0.0.0/8 for the control and data networks.

    Args:
        rng: the draw.
        taken: networks already in use on this machine (``10.1.2.0/24``, ``10.0.0.0/8``, ...).

    Returns:
        ``(control, data)``, e.g. ``("10.77.40.0/24", "10.77.41.0/24")``.

    Raises:
        RuntimeError: no free pair found in 500 draws.
    """
    used = [ipaddress.ip_network(t, strict=False) for t in taken]
    for _ in range(500):
        a, b = rng.randrange(16, 250), rng.randrange(0, 254, 2)
        pair = [ipaddress.ip_network(f"10.{a}.{b + k}.0/24") for k in (0, 1)]
        if not any(p.overlaps(u) for p in pair for u in used if u.version == 4):
            return str(pair[0]), str(pair[1])
    raise RuntimeError("no free pair of 10.x.y.0/24 networks on this machine for the bed")


def plan_bed(names: list[str], bed_id: str, subnets: tuple[str, str]) -> BedPlan:
    """Names and addresses of a bed of ``names`` (hostnames).

    Args:
        names: the hostnames, as ``check_names`` accepts them.
        bed_id: six hex digits (``new_bed_id``).
        subnets: ``(control, data)`` /24 networks (``choose_subnets``).

    Returns:
        The plan (no holder pids, no servers yet).

    Raises:
        ValueError: a bad name, id or subnet.
    """
    check_names(names)
    if not _BED_ID.match(bed_id):
        raise ValueError(f"bad bed id {bed_id!r}: six lowercase hex digits")
    nets = {net: ipaddress.ip_network(s) for net, s in zip(NETS, subnets)}
    if any(n.prefixlen != 24 or n.version != 4 for n in nets.values()):
        raise ValueError(f"bed subnets must be IPv4 /24s, not {subnets}")
    hosts = []
    for i, name in enumerate(names, start=1):
        links = {net: Link(net=net, veth=f"mb{bed_id}{net[0]}{i}", ifname=INNER_IFNAME[net],
                           addr=str(nets[net].network_address + 10 + i)) for net in NETS}
        hosts.append(HostPlan(name=name, netns=f"mb-{bed_id}-{name}", control=links[CONTROL],
                              data=links[DATA]))
    return BedPlan(bed_id=bed_id, bridges={net: f"mb{bed_id}{net[0]}" for net in NETS},
                   subnets={net: str(n) for net, n in nets.items()},
                   server_addrs={net: str(n.network_address + 1) for net, n in nets.items()},
                   hosts=tuple(hosts))


SERVER_NAME = "bed-server"


def hosts_file(plan: BedPlan) -> str:
    """The ``/etc/hosts`` every host sees.

    A hostname resolves to the host's **data** address (so torch's
    ``socket.getfqdn()``, the default rendezvous ``local_addr``, puts
    ``MASTER_ADDR`` and the workers' store on the data network);
    ``NAME-ctl`` and ``NAME-data`` name each link; ``bed-server`` is the
    bridge side's control address (etcd, S3).
    """
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{plan.server_addrs[CONTROL]}\t{SERVER_NAME} {SERVER_NAME}-ctl",
             f"{plan.server_addrs[DATA]}\t{SERVER_NAME}-data"]
    for h in plan.hosts:
        lines.append(f"{h.data.addr}\t{h.name} {h.name}-data")
        lines.append(f"{h.control.addr}\t{h.name}-ctl")
    return "\n".join(lines) + "\n"


def host_env(plan: BedPlan) -> dict[str, str]:
    """The environment that keeps a host's worker collectives on its data link.

    gloo picks its interface from ``GLOO_SOCKET_IFNAME`` (NCCL from
    ``NCCL_SOCKET_IFNAME``, tensorpipe from ``TP_SOCKET_IFNAME``); the inner
    names are the same in every host. etcd is reached by its control
    address (the agent's ``--etcd``), so it never needs the data link.
    """
    data = INNER_IFNAME[DATA]
    env = {"GLOO_SOCKET_IFNAME": data, "NCCL_SOCKET_IFNAME": data, "TP_SOCKET_IFNAME": data}
    if plan.etcd:
        env["MARIND_ETCD"] = plan.etcd
    return env


def to_state(plan: BedPlan) -> dict:
    """The state file's JSON document (``STATE_VERSION``)."""
    doc = asdict(plan)
    doc["version"] = STATE_VERSION
    return doc


def from_state(doc: dict) -> BedPlan:
    """A plan back from ``to_state``'s document.

    Raises:
        ValueError: not a bed state document of this version.
    """
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        raise ValueError(f"not a bed state file of version {STATE_VERSION}")
    try:
        hosts = tuple(HostPlan(name=h["name"], netns=h["netns"], control=Link(**h["control"]),
                               data=Link(**h["data"]), holder_pid=h.get("holder_pid"))
                      for h in doc["hosts"])
        return BedPlan(bed_id=doc["bed_id"], bridges=dict(doc["bridges"]), subnets=dict(doc["subnets"]),
                       server_addrs=dict(doc["server_addrs"]), hosts=hosts, etcd=doc.get("etcd"),
                       s3=doc.get("s3"), owner_pid=int(doc["owner_pid"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bed state file is missing {exc}") from exc


def state_path(location: str | os.PathLike) -> Path:
    """The state file for ``--bed``/``MARIND_BED``: a directory (its ``bed.json``) or the file."""
    path = Path(location)
    return path / STATE_FILE if path.is_dir() else path


def write_state(path: str | os.PathLike, plan: BedPlan) -> None:
    """Write the state file atomically (a reader never sees half of it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_state(plan), indent=1))
    os.replace(tmp, path)


def read_state(location: str | os.PathLike) -> BedPlan:
    """The bed recorded at ``location`` (see ``state_path``).

    Raises:
        FileNotFoundError: no state file there (no bed, or it was torn down).
        ValueError: the file is not a bed state file.
    """
    path = state_path(location)
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    return from_state(doc)

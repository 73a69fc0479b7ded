"""The system calls behind the test bed: iproute2, namespaces, and the processes inside them.

Everything here acts on names the bed chose (``marind.testing.hosts_plan``)
and nothing global: no sysctl, no forwarding, no firewall rule. A host's
processes are the processes whose network namespace is the host's
(``/proc/PID/ns/net`` compared with ``/run/netns/NAME``), so a process a
host's command started, however it daemonized, is still found.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from marind.core.log import get_logger

log = get_logger("testing.hosts")

NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")


class BedError(RuntimeError):
    """An iproute2 or namespace operation of the bed failed; the message has the command and its error."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``.

    Raises:
        BedError: it failed and ``check`` (the message has the command and ``ip``'s stderr).
    """
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise BedError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
    return res


def ip_batch(commands: list[str]) -> None:
    """Run several ``ip`` commands in one process (``ip -batch -``): one fork, one instant.

    Raises:
        BedError: one of them failed.
    """
    res = subprocess.run(["ip", "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        raise BedError(f"`ip -batch` of {commands} failed: {res.stderr.strip()}")


@functools.lru_cache(maxsize=1)
def bed_unavailable() -> str | None:
    """Why a bed cannot be built here (one line), or None when it can.

    Checks root, ``ip``/``unshare``/``nsenter`` on ``PATH``, and that a
    network and a UTS namespace can actually be made (a container may forbid it).
    """
    if os.geteuid() != 0:
        return "the multi-host bed needs root (network namespaces)"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"the multi-host bed needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"mb-probe-{os.getpid()}"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    uts = subprocess.run(["unshare", "--uts", "--", "true"], capture_output=True, text=True, timeout=30)
    if uts.returncode != 0:
        return f"cannot create a UTS namespace here: {uts.stderr.strip()}"
    return None


def taken_networks() -> list[str]:
    """The IPv4 networks this machine's root namespace already has (addresses and routes)."""
    out = []
    for args in (("-j", "-4", "addr"), ("-j", "-4", "route")):
        try:
            doc = json.loads(ip(*args).stdout or "[]")
        except (BedError, json.JSONDecodeError):
            continue
        for entry in doc:
            for addr in entry.get("addr_info", []):
                out.append(f"{addr['local']}/{addr['prefixlen']}")
            dst = entry.get("dst")
            if dst and dst != "default":
                out.append(dst if "/" in dst else f"{dst}/32")
    return [n for n in out if _is_net(n)]


def _is_net(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
        return True
    except ValueError:
        return False


def add_bridge(name: str, addr: str) -> None:
    """A bridge with ``addr``/24, up; bridged frames skip iptables (per bridge, nothing global)."""
    if ip("link", "add", name, "type", "bridge", "nf_call_iptables", "0", check=False).returncode != 0:
        ip("link", "add", name, "type", "bridge")
    ip("addr", "add", f"{addr}/24", "dev", name)
    ip("link", "set", name, "up")


def add_netns(name: str) -> None:
    """A named network namespace with its loopback up."""
    ip("netns", "add", name)
    ip("-n", name, "link", "set", "lo", "up")


def add_link(netns: str, outer: str, inner: str, bridge: str, addr: str) -> None:
    """A veth pair: ``outer`` on ``bridge`` (root namespace), ``inner`` in ``netns`` with ``addr``/24."""
    ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", netns)
    ip("link", "set", outer, "master", bridge, "up")
    ip("-n", netns, "addr", "add", f"{addr}/24", "dev", inner)
    ip("-n", netns, "link", "set", inner, "up")


def set_links(veths: list[str], up: bool) -> None:
    """Set outer veth ends up or down, all in one ``ip`` process.

    Down, the bridge drops every frame to and from the host without a
    word (peers see silence, not a reset) and the host's inner end loses
    its carrier (its own packets are dropped as silently).
    """
    state = "up" if up else "down"
    ip_batch([f"link set {v} {state}" for v in veths])


def set_forwarding(veths: list[str], on: bool) -> None:
    """Let the bridge forward frames of the outer veth ends ``veths`` or drop them, carriers kept.

    Off (bridge port state ``disabled``), the bridge drops every frame to and from the host
    without a word while both ends of the veth keep their carrier: a switch that drops a
    host's traffic, which the host's own link state cannot tell from a working one.
    """
    state = "3" if on else "0"       # forwarding / disabled
    deadline = time.monotonic() + 5.0
    while True:
        res = subprocess.run(["bridge", "-batch", "-"], input="".join(f"link set dev {v} state {state}\n" for v in veths),
                             capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            return
        # a port set up a moment ago is not operationally up yet (its veth's carrier comes asynchronously):
        # the kernel refuses any state but disabled until it is
        if "Network is down" not in res.stderr or time.monotonic() > deadline:
            raise BedError(f"`bridge -batch` setting {veths} to state {state} failed: {res.stderr.strip()}")
        time.sleep(0.05)


def link_is_up(veth: str) -> bool:
    """Whether the outer end ``veth`` is administratively up."""
    res = ip("-j", "link", "show", veth, check=False)
    if res.returncode != 0:
        return False
    return "UP" in json.loads(res.stdout)[0].get("flags", [])


def link_exists(name: str) -> bool:
    return ip("link", "show", name, check=False).returncode == 0


def delete_link(name: str) -> None:
    """Delete a link (one end of a veth takes the other with it); gone already is fine."""
    ip("link", "del", name, check=False)


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def delete_netns(name: str) -> None:
    ip("netns", "del", name, check=False)


def write_hosts_file(netns: str, text: str) -> Path:
    """``/etc/netns/NETNS/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``."""
    path = ETC_NETNS / netns / "hosts"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def remove_etc_netns(netns: str) -> None:
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def holder_command(netns: str, hostname: str) -> list[str]:
    """The process that holds a host's namespaces.

    ``ip netns exec`` enters the network namespace and a mount namespace
    where ``/etc/netns/NETNS/hosts`` is ``/etc/hosts``; ``unshare --uts``
    gives it a hostname of its own; then it sleeps forever, as the pid
    every command of the host enters (``enter_command``).
    """
    return ["ip", "netns", "exec", netns, "unshare", "--uts", "--", "sh", "-c",
            'hostname "$1" && exec sleep infinity', "marind-bed-holder", hostname]


def wait_holder_ready(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until the holder has set its hostname and become ``sleep``.

    Raises:
        BedError: it exited, or did not get there within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise BedError(f"the host's holder exited with {proc.returncode}: {proc.args!r}: {err}")
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise BedError(f"the host's holder (pid {proc.pid}) was not ready within {timeout}s")


def enter_command(holder_pid: int, cwd: str | os.PathLike) -> list[str]:
    """The prefix that runs a command in a host: its hostname, network and ``/etc/hosts``.

    Entering the holder's mount namespace resets the working directory, so
    ``--wd`` sets it again (the mount namespace is a slave of the root
    one: the same files, the host's ``/etc/hosts``).
    """
    return ["nsenter", f"--target={holder_pid}", "--uts", "--net", "--mount", f"--wd={cwd}", "--"]


def netns_inode(netns: str) -> tuple[int, int] | None:
    """The (device, inode) of a named network namespace, or None if there is none."""
    try:
        st = os.stat(NETNS_DIR / netns)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in_netns(netns: str) -> list[int]:
    """Every live process whose network namespace is ``netns`` (zombies have none)."""
    target = netns_inode(netns)
    if target is None:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:        # gone, a zombie, or not ours to read
            continue
        if (st.st_dev, st.st_ino) == target:
            found.append(int(entry.name))
    return sorted(found)


def signal_pids(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each pid; the pids that got it (gone ones are skipped)."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def kill_netns_processes(netns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``netns`` (stopped ones too) until none is left; the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = pids_in_netns(netns)
        if not pids:
            break
        killed |= set(signal_pids(pids, signal.SIGKILL))
        time.sleep(0.05)
    return sorted(killed)


def wait_gone(leftovers, timeout: float) -> list[str]:
    """Poll ``leftovers()`` (a namespace's links go asynchronously) until empty or ``timeout``."""
    deadline = time.monotonic() + timeout
    left = leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leftovers()
    return left


def established_tcp(proc_net_tcp: str) -> list[tuple[str, str]]:
    """The ESTABLISHED connections in a ``/proc/net/tcp`` or ``tcp6`` text, as ``("A:PORT", "B:PORT")``.

    IPv4-mapped IPv6 addresses (a dual-stack socket's, gRPC's) are given as IPv4.
    """
    out = []
    for line in proc_net_tcp.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != "01":     # 01 = TCP_ESTABLISHED
            continue
        out.append((_hex_endpoint(parts[1]), _hex_endpoint(parts[2])))
    return out


def _hex_endpoint(text: str) -> str:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"
    # four 32-bit words, each in host (little-endian) order
    ip6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip6.ipv4_mapped or ip6}:{int(port, 16)}"

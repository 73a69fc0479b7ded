"""A multi-host test bed on one machine: N hosts, each with its own hostname and two networks.

    with HostBed(tmp_path, ["host1", "host2"]) as bed:       # etcd on the control network
        bed.start_agent("host1", prefix)                      # `marind agent` inside host1
        bed.run("host2", ["hostname"]).stdout                 # "host2\\n"
        bed.cut("host1", "data")                              # peers now see silence
        bed.restore("host1", "data")

What a host is: a network namespace (``mb-{id}-{name}``) and a UTS
namespace (its hostname), held by a ``sleep`` process that every command of
the host enters (``nsenter --target HOLDER --uts --net --mount``; the mount
namespace is the one ``ip netns exec`` made, where ``/etc/netns/NS/hosts``
is ``/etc/hosts``). Each host has two links, each a veth pair whose outer end
is on a bridge the bed made: **control** (``ctl0`` inside; etcd and S3) and
**data** (``data0`` inside; the workers' collectives and store). etcd
(``marind.control.local_etcd``) and, when asked, S3 (``marind.testing.s3_server``)
run on the bridge side, at the control bridge's address. Naming and
addresses: ``marind.testing.hosts_plan``.

Which network carries what:

* etcd and S3: the agent's ``--etcd`` is the control bridge's address, so
  the agent, torchrun's rendezvous (``--rdzv-endpoint``, from the agent)
  and the workers reach etcd over ``ctl0``;
* the workers' store and collectives: a hostname resolves to the host's
  **data** address (``hosts_plan.hosts_file``), so torch's default
  ``local_addr`` (``socket.getfqdn()``) makes ``MASTER_ADDR`` a data
  address; ``GLOO_SOCKET_IFNAME=data0`` (and ``NCCL_``/``TP_SOCKET_IFNAME``)
  pins gloo's sockets to the data link. ``HostBed.env(host)`` is that
  environment; ``popen``/``run``/``start_agent`` apply it. A launcher that
  passes torchrun's ``--local-addr`` or sets ``MASTER_ADDR`` itself gives the
  hostname or ``bed.addr(host, "data")``; ``--rdzv-endpoint`` stays etcd's
  control address.

Faults: ``cut``/``restore`` set a link's outer end down/up (the bridge then
drops the host's frames without a reset; the host's inner end loses its
carrier); ``power_off``/``power_on`` also SIGSTOP/SIGCONT the host's
processes. Links that half work (``drop_one_way``, ``lossy``, ``heal``) are
nftables filters in the hosts' own namespaces (``marind.testing.hosts_filter``;
they need ``nft``: ``nft_unavailable()`` says why not). ``chaos/power_off.py`` and ``chaos/partition.py`` act on a bed
through its state file (``bed.json`` in the bed's directory; scripts take
``--bed DIR`` or ``MARIND_BED``). Nothing global is changed: no forwarding,
no default route in a host, no firewall rule in the root namespace (the
filters are in the hosts' namespaces, in a table of the bed's own),
addresses only on the bed's own bridges and veths. ``close()`` (also on an exception inside ``with``)
kills every process in every host's namespace and every process group
the bed started, stops the servers, and deletes the namespaces, links,
bridges and ``/etc/netns`` entries; ``leftovers()`` lists what remains.
A bed whose owner was killed before ``close()`` is removed by the next bed
built (``marind.testing.hosts_sweep``). Needs root, iproute2 and
util-linux: ``bed_unavailable()`` says why not.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from marind.control.local_etcd import LocalEtcd
from marind.core.log import get_logger
from marind.testing import hosts_net as net
from marind.testing.chaos import host_faults
from marind.testing.chaos.host_faults import Frozen
from marind.testing.etcd_cluster import EtcdCluster
from marind.testing.hosts_filter import Filters, fault_key, lossy_rules, nft_unavailable, one_way_rules
from marind.testing.hosts_net import BedError, bed_unavailable
from marind.testing.hosts_plan import (
    BED_ENV,
    CONTROL,
    DATA,
    NETS,
    BedPlan,
    HostPlan,
    choose_subnets,
    host_env,
    hosts_file,
    nets_of,
    new_bed_id,
    plan_bed,
    write_state,
)
from marind.testing.hosts_sweep import register, remove_network, sweep_stale, unregister
from marind.testing.procs import REPO_ROOT, kill_group, spawn
from marind.testing.s3_server import SeaweedS3

__all__ = ["HostBed", "BedError", "bed_unavailable", "nft_unavailable", "nets_of", "BED_ENV"]

log = get_logger("testing.hosts")

#: an agent's defaults in the bed, as tests/agent/helpers.py has them: short rendezvous timeouts
AGENT_ENV = {"MARIND_RDZV_CONF": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,"
                                 "join_timeout=120",
             "MARIND_REPORT_INTERVAL": "0.5", "MARIND_STOP_TIMEOUT": "15"}


class HostBed:
    """N hosts on this machine, their two networks, and etcd (and S3) on the bridge side.

    Args:
        root: the bed's directory (state file, logs, server data, agents' state dirs).
        names: the hostnames.
        etcd: start etcd on the control network.
        etcd_members: how many etcd members (1, or a real cluster of 3 or 5 whose leader and
            members a scenario can kill: ``bed.etcd`` is then an ``EtcdCluster``).
        s3: start S3 (SeaweedFS) on the control network.
        seed: seeds the bed's id and subnets (default: random).
    """

    def __init__(self, root: str | os.PathLike, names: list[str] | tuple[str, ...] = ("host1", "host2"), *,
                 etcd: bool = True, s3: bool = False, seed: int | None = None, etcd_members: int = 1):
        self.root = Path(root)
        self.etcd_members = etcd_members
        self.names = list(names)
        self.want_etcd, self.want_s3 = etcd, s3
        self._seed = seed
        self._rng = random.Random(seed)
        self.plan: BedPlan | None = None
        self.etcd: LocalEtcd | EtcdCluster | None = None
        self.s3: SeaweedS3 | None = None
        self._procs: list[subprocess.Popen] = []
        self._holders: dict[str, subprocess.Popen] = {}
        self._filters: Filters | None = None

    # -- building and tearing down ---------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        """The state file the chaos scripts read (``ROOT/bed.json``)."""
        return self.root / "bed.json"

    def start(self) -> HostBed:
        """Build the bed: bridges, hosts, their holders, the servers, the state file.

        Returns:
            self.

        Raises:
            BedError: the machine cannot host a bed (the reason), or a step failed;
                whatever was built is removed first.
            ValueError: bad hostnames.
        """
        reason = bed_unavailable()
        if reason:
            raise BedError(reason)
        stale = sweep_stale()
        if stale:
            log.warning("stale_beds_removed", beds=stale)
        self.root.mkdir(parents=True, exist_ok=True)
        bed_id = new_bed_id(self._rng if self._seed is not None else None)
        self.plan = plan_bed(self.names, bed_id, choose_subnets(self._rng, net.taken_networks()))
        register(self.plan)               # from now on a crash of this process is swept up later
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.info("bed_started", bed=bed_id, hosts=self.names, etcd=self.plan.etcd,
                 subnets=self.plan.subnets)
        return self

    def _build(self) -> None:
        plan = self._plan()
        for n in NETS:
            net.add_bridge(plan.bridges[n], plan.server_addrs[n])
        text = hosts_file(plan)
        hosts = []
        for host in plan.hosts:
            net.add_netns(host.netns)
            for n in NETS:
                link = host.link(n)
                net.add_link(host.netns, link.veth, link.ifname, plan.bridges[n], link.addr)
            net.write_hosts_file(host.netns, text)
            holder = subprocess.Popen(net.holder_command(host.netns, host.name), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True)
            self._holders[host.name] = holder
            net.wait_holder_ready(holder)
            hosts.append(replace(host, holder_pid=holder.pid))
        self.plan = replace(plan, hosts=tuple(hosts))
        addr = plan.server_addrs[CONTROL]
        if self.want_etcd and self.etcd_members > 1:
            self.etcd = EtcdCluster(self.root / "etcd", self.etcd_members, host=addr).start()
            self.plan = replace(self.plan, etcd=self.etcd.endpoints)
        elif self.want_etcd:
            self.etcd = LocalEtcd(self.root / "etcd" / "data", host=addr).start()
            self.plan = replace(self.plan, etcd=self.etcd.endpoint)
        if self.want_s3:
            self.s3 = SeaweedS3(self.root / "s3", host=addr).start()
            self.plan = replace(self.plan, s3=self.s3.endpoint)
        servers = [server.pid for server in (self.etcd, self.s3) if isinstance(server, LocalEtcd | SeaweedS3)]
        if isinstance(self.etcd, EtcdCluster):
            servers += [m.pid for m in self.etcd.members]
        register(self.plan, [pid for pid in servers if pid])
        write_state(self.state_path, self.plan)

    def close(self) -> None:
        """Remove everything the bed made; safe to call twice, and after a failed ``start``.

        Raises:
            BedError: something could not be removed (listed).
        """
        if self.plan is None:
            return
        plan = self.plan
        if self._filters is not None:
            try:
                self._filters.remove()      # the namespaces' deletion below takes the tables anyway
            except BedError as exc:
                log.warning("filters_not_removed", error=str(exc))
            self._filters = None
        for proc in self._procs:
            kill_group(proc)
        for host in plan.hosts:
            net.kill_netns_processes(host.netns)
        for proc in [*self._procs, *self._holders.values()]:
            kill_group(proc)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                log.warning("process_not_reaped", pid=proc.pid)
        self._procs.clear()
        self._holders.clear()
        for server in (self.s3, self.etcd):
            if server is not None:
                try:
                    server.stop()
                except Exception as exc:  # noqa: BLE001 - keep tearing down; reported in leftovers
                    log.warning("server_stop_failed", error=str(exc))
        self.s3 = self.etcd = None
        remove_network(plan)
        self.state_path.unlink(missing_ok=True)
        left = net.wait_gone(self.leftovers, timeout=10.0)
        if left:
            raise BedError(f"bed {plan.bed_id} left behind: {', '.join(left)}")
        unregister(plan.bed_id)
        log.info("bed_closed", bed=plan.bed_id)

    def leftovers(self) -> list[str]:
        """What of this bed still exists: namespaces, links, /etc/netns dirs, live processes."""
        if self.plan is None:
            return []
        plan = self.plan
        out = [f"netns {h.netns}" for h in plan.hosts if net.netns_exists(h.netns)]
        out += [f"/etc/netns/{h.netns}" for h in plan.hosts if (net.ETC_NETNS / h.netns).exists()]
        names = [*plan.bridges.values(), *(h.link(n).veth for h in plan.hosts for n in NETS)]
        out += [f"link {name}" for name in names if net.link_exists(name)]
        out += [f"pid {p.pid}" for p in [*self._procs, *self._holders.values()] if p.poll() is None]
        return out

    def __enter__(self) -> HostBed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things in a host -----------------------------------------------------------------

    def _plan(self) -> BedPlan:
        if self.plan is None:
            raise BedError("the bed is not started: call start() or use it as a context manager")
        return self.plan

    def host(self, name: str) -> HostPlan:
        """The host ``name`` (its namespace, links, addresses, holder pid).

        Raises:
            KeyError: no such host.
        """
        return self._plan().host(name)

    def env(self, name: str, extra: dict | None = None) -> dict[str, str]:
        """The environment of a command in host ``name``: the data-network pins
        (``hosts_plan.host_env``), ``MARIND_ETCD``, ``MARIND_BED``, then ``extra``."""
        self.host(name)
        env = {**host_env(self._plan()), BED_ENV: str(self.root)}
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def popen(self, name: str, cmd: list[str], *, env: dict | None = None,
              cwd: str | os.PathLike | None = None, stdout=None, stderr=None) -> subprocess.Popen:
        """Start ``cmd`` in host ``name``, in a process group of its own (killed by ``close()``).

        Args:
            name: the host.
            cmd: the command.
            env: variables on top of this process's and ``env(name)``'s.
            cwd: its working directory (default: the repository).
            stdout: as ``subprocess.Popen``'s.
            stderr: as ``subprocess.Popen``'s.

        Returns:
            The process; its pid is the command's own (nsenter execs it).
        """
        host = self.host(name)
        if not host.holder_pid:
            raise BedError(f"host {name} has no holder process")
        wd = Path(cwd or REPO_ROOT)
        proc = spawn([*net.enter_command(host.holder_pid, wd), *cmd], env=self.env(name, env), cwd=wd,
                     stdout=stdout, stderr=stderr)
        self._procs.append(proc)
        return proc

    def run(self, name: str, cmd: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None,
            timeout: float = 60.0, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` in host ``name`` and wait; its output as text.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (its process group is killed).
            subprocess.CalledProcessError: it failed and ``check``.
        """
        proc = self.popen(name, cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            raise
        finally:
            if proc in self._procs and proc.poll() is not None:
                self._procs.remove(proc)
        res = subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"),
                                          err.decode(errors="replace"))
        if check:
            res.check_returncode()
        return res

    def python(self, name: str, code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``python -c CODE ARGS`` in host ``name`` (this interpreter)."""
        return self.run(name, [sys.executable, "-c", code, *args], timeout=timeout)

    def start_agent(self, name: str, prefix: str, *, node: str | None = None, slots: int = 2,
                    env: dict | None = None) -> subprocess.Popen:
        """``marind agent`` in host ``name``, on the bed's etcd, the way the agent tests start one.

        Args:
            name: the host.
            prefix: the etcd key prefix (``MARIND_PREFIX``).
            node: ``--node``; default: none given, so the agent takes the host's hostname.
            slots: ``--slots``.
            env: on top of ``AGENT_ENV`` and ``env(name)``.

        Returns:
            The agent's process; its log is ``ROOT/agent-{node or name}.log``, its state dir
            ``ROOT/state-{node or name}``.

        Raises:
            BedError: the bed has no etcd.
        """
        plan = self._plan()
        if not plan.etcd:
            raise BedError("the bed was built without etcd: HostBed(..., etcd=True)")
        label = node or name
        state = self.root / f"state-{label}"
        state.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "marind", "agent", "--etcd", plan.etcd, "--state-dir", str(state),
               "--slots", str(slots), "--metrics-port", "-1", *(["--node", node] if node else [])]
        with open(self.root / f"agent-{label}.log", "ab") as logf:
            return self.popen(name, cmd, env={"MARIND_PREFIX": prefix, **AGENT_ENV, **(env or {})},
                              stdout=logf, stderr=subprocess.STDOUT)

    def pids(self, name: str) -> list[int]:
        """The live processes of host ``name`` (its holder included)."""
        return net.pids_in_netns(self.host(name).netns)

    # -- links ------------------------------------------------------------------------------------

    def cut(self, name: str, which: str = "both") -> list[str]:
        """Cut host ``name``'s ``control``, ``data`` or ``both`` links; the veths set down."""
        veths = [self.host(name).link(n).veth for n in nets_of(which)]
        net.set_links(veths, up=False)
        return veths

    def drop(self, name: str, which: str = "both") -> list[str]:
        """The bridge drops host ``name``'s ``control``, ``data`` or ``both`` frames; carriers kept."""
        veths = [self.host(name).link(n).veth for n in nets_of(which)]
        net.set_forwarding(veths, on=False)
        return veths

    def restore(self, name: str, which: str = "both") -> list[str]:
        """Restore what ``cut`` or ``drop`` did; the veths set up and forwarding."""
        veths = [self.host(name).link(n).veth for n in nets_of(which)]
        net.set_links(veths, up=True)
        net.set_forwarding(veths, on=True)
        return veths

    # -- half-working links (nftables in the hosts' namespaces: marind.testing.hosts_filter) --------

    def drop_one_way(self, src: str, dst: str, which: str = DATA) -> list[str]:
        """``src``'s packets to ``dst`` on ``control``/``data``/``both`` vanish, ``dst``'s to ``src`` arrive
        (TCP fails both ways: half its handshake is gone); the hosts whose filters changed.

        Raises:
            BedError: no ``nft`` here (``nft_unavailable``), or it refused the rules.
        """
        return self._filters_of().add(fault_key("one-way", src, dst, which=which),
                                      one_way_rules(self._plan(), src, dst, which))

    def lossy(self, name: str, which: str = DATA, percent: float = 25) -> list[str]:
        """``percent`` (whole, 1..100) of host ``name``'s IPv4 packets on ``which`` vanish, each way, each
        packet drawn alone (a second call replaces the share); the hosts whose filters changed.

        Raises:
            BedError: no ``nft`` here, or it refused the rules.
        """
        return self._filters_of().add(fault_key("lossy", name, which=which),
                                      lossy_rules(self._plan(), name, which, percent))

    def heal(self, name: str | None = None) -> list[str]:
        """Remove the filters of every fault involving host ``name`` (None: all); the faults removed."""
        return self._filters.remove(name) if self._filters is not None else []

    def _filters_of(self) -> Filters:
        self._filters = self._filters or Filters(self._plan())
        return self._filters

    def power_off(self, name: str) -> list[Frozen]:
        """What ``chaos/power_off.py`` does, in process: cut both links, SIGSTOP every process.

        Returns:
            The stopped processes, for ``power_on``.
        """
        self.cut(name, "both")
        return host_faults.freeze(self.host(name))

    def power_on(self, name: str, frozen: list[Frozen]) -> list[int]:
        """Undo ``power_off``: restore both links, SIGCONT what it stopped; the pids continued."""
        self.restore(name, "both")
        return host_faults.resume(frozen)

    def addr(self, name: str, which: str = DATA) -> str:
        """Host ``name``'s address on ``control`` or ``data``."""
        return self.host(name).link(which).addr

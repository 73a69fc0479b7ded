"""`marind doctor`: the environment check to run before a big job.

Checks torch/CUDA/NCCL versions, backend availability, an all-reduce
across 2 local processes, etcd reachability with a write test, each etcd
member's health and which one leads (a member down while the others hold a
quorum is a warning; no quorum fails), the registered agents' state dirs
(a node whose agent says its state dir is full fails), the
checkpoint store (fsspec) with a write/read/delete test, the etcd binary
for the embedded default, and free disk in the state dir. Prints a
pass/fail table with the fix for each failure; exit 1 if any fails.

``--cluster`` runs the cluster check instead (``marind.doctor_cluster``):
through the agents, one all-reduce across every registered host; a row
per host (reachable from how many peers, latency, bus bandwidth, error),
the failing hosts named; exit 1 if any fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marind.doctor_cluster.verdict import Report

MIN_FREE_BYTES = 5 * 2**30

_ALLREDUCE = """
import os, torch, torch.distributed as dist
from marind.distributed import init_distributed, shutdown_distributed
device = init_distributed(timeout_s=60)
t = torch.ones(4, device=device) * (dist.get_rank() + 1)
dist.all_reduce(t)
assert t.tolist() == [3.0] * 4, t.tolist()
shutdown_distributed()
"""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False           # passed, but something needs a look (an etcd member down, quorum held)


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this node's environment (pass/fail table; exit 1 on a failure)")
    p.add_argument("--etcd", help="etcd endpoints (default: the documented lookup)")
    p.add_argument("--config", help="config file")
    p.add_argument("--ckpt", help="checkpoint store URL to test (file:///..., s3://bucket/prefix)")
    p.add_argument("--storage-options", help='JSON options for fsspec, e.g. \'{"client_kwargs": {"endpoint_url": "..."}}\'')
    p.add_argument("--state-dir", help="state dir to check for free disk")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cluster", action="store_true",
                   help="through the agents: one all-reduce across every registered host (a row per host)")
    p.add_argument("--bytes", type=int, help="--cluster: the bandwidth all-reduce's size (default 32 MiB)")
    p.add_argument("--timeout", type=float, help="--cluster: seconds the check may take (default 90)")
    p.set_defaults(handler=run)


def check_torch() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return [Check("torch", False, str(exc), "install torch into this environment (`make setup`)")]
    out = [Check("torch", True, f"torch {torch.__version__}, python {sys.version.split()[0]}")]
    if torch.cuda.is_available():
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = "unavailable"
        out.append(Check("cuda", True, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), NCCL {nccl}"))
    else:
        out.append(Check("cuda", True, "no GPU: CPU with gloo (fine for tests, slow for training)"))
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    want = "nccl" if torch.cuda.is_available() else "gloo"
    out.append(Check("backends", want in backends, f"available: {', '.join(backends) or 'none'}",
                     f"this torch build lacks {want}; install the official wheel"))
    return out


def check_allreduce(timeout: float = 90.0) -> Check:
    from marind.core.netutil import free_port
    port = free_port()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, "-c", _ALLREDUCE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    tic = time.monotonic()
    failures = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - tic)))
            if proc.returncode != 0:
                failures.append(f"rank {rank} exited {proc.returncode}: "
                                f"{(out or b'').decode(errors='replace').strip().splitlines()[-1:]}")
        except subprocess.TimeoutExpired:
            failures.append(f"rank {rank} timed out after {timeout:.0f}s")
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(5)
    if failures:
        return Check("all-reduce", False, "; ".join(failures),
                     "check loopback networking (MASTER_ADDR=127.0.0.1) and the backend (NCCL_DEBUG=INFO)")
    return Check("all-reduce", True, f"2 local processes in {time.monotonic() - tic:.1f}s")


def check_etcd(flag: str | None, config_file: str | None) -> Check:
    from marind.control.jobs_client import connect
    from marind.core.errors import MarindError
    try:
        client = connect(flag, config_file)
    except MarindError as exc:
        return Check("etcd", False, str(exc), "start etcd or `marind agent`, or pass --etcd / set MARIND_ETCD")
    try:
        key = client.key("doctor", f"{socket.gethostname()}-{os.getpid()}")
        value = uuid.uuid4().hex
        client.put(key, value)
        ok = client.get(key)[0] == value.encode()
        client.delete(key)
        return Check("etcd", ok, f"{client.endpoints_spec} prefix {client.prefix}: write/read/delete "
                                 + ("ok" if ok else "read back a different value"),
                     "" if ok else "check etcd health (`etcdctl endpoint health`)")
    except MarindError as exc:
        return Check("etcd", False, str(exc), "grant the etcd user read/write on the prefix")
    finally:
        client.close()


def check_etcd_members(flag: str | None, config_file: str | None) -> list[Check]:
    """A row per etcd member given: up or down, leader or follower, raft term, database size.

    A member down while a quorum of the others holds passes with a warning (the cluster
    serves every request); no quorum, or no member answering, fails.
    """
    from marind.control.config import client_settings, resolve_endpoint
    from marind.core.errors import MarindError
    from marind.core.etcd_members import cluster_status, leader_endpoint
    try:
        endpoints, _ = resolve_endpoint(flag, config_file)
    except MarindError:
        return []                 # check_etcd says why
    settings = client_settings(config_file)
    statuses = cluster_status(endpoints, tls=settings["tls"], user=settings["user"], password=settings["password"])
    leader = leader_endpoint(statuses)
    up = sum(s.healthy for s in statuses)
    quorum = up * 2 > len(statuses)
    checks = []
    for s in statuses:
        if s.healthy:
            role = "leader" if s.endpoint == leader else "follower"
            checks.append(Check(f"etcd member {s.endpoint}", True,
                                f"{role}, member {s.member_id:x}, raft term {s.raft_term}, "
                                f"db {s.db_size / 2**20:.1f} MiB, etcd {s.version}"))
        else:
            checks.append(Check(f"etcd member {s.endpoint}", quorum,
                                f"down: {s.error}" + (f" ({up} of {len(statuses)} members up: quorum holds)"
                                                      if quorum else ""),
                                "start the member again (its data dir restores it), or replace it "
                                "(`etcdctl member remove/add`)" if quorum else
                                "no quorum: start members until a majority runs; etcd serves nothing until then",
                                warn=quorum))
    return checks


def check_agent_state_dirs(flag: str | None, config_file: str | None) -> Check | None:
    """A row from the registered agents' own word: FAIL naming each node whose state dir is full
    (its record's ``state_dir_full``); None when etcd cannot be asked (``check_etcd`` says why)."""
    from marind.control.jobs_client import connect, node_issues
    from marind.control.nodes import live_nodes
    from marind.core.errors import MarindError
    try:
        client = connect(flag, config_file)
    except MarindError:
        return None
    try:
        nodes = live_nodes(client)
    except MarindError:
        return None
    finally:
        client.close()
    issues = node_issues(nodes)
    if issues:
        return Check("agent state dirs", False, "; ".join(issues.values()),
                     "free space in that state dir; its agent sees it within seconds, says so (an event on "
                     "each job) and starts jobs there again")
    return Check("agent state dirs", True, f"{len(nodes)} agent(s) registered, none with a full state dir")


def check_store(url: str, storage_options: dict | None = None) -> Check:
    try:
        import fsspec
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        path = root.rstrip("/") + f"/.marind-doctor-{uuid.uuid4().hex[:8]}"
        data = os.urandom(1024)
        fs.makedirs(root, exist_ok=True)
        with fs.open(path, "wb") as fh:
            fh.write(data)
        with fs.open(path, "rb") as fh:
            same = fh.read() == data
        fs.rm(path)
        return Check("checkpoint store", same, f"{url}: write/read/delete {'ok' if same else 'mismatch'}",
                     "" if same else "the store returned different bytes; check it")
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return Check("checkpoint store", False, f"{url}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                     "check the URL, credentials (AWS_* / storage options) and permissions")


def check_disk(path: str) -> Check:
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe or "/").free
    return Check("free disk", free >= MIN_FREE_BYTES, f"{free / 2**30:.1f} GiB free at {probe}",
                 f"free at least {MIN_FREE_BYTES // 2**30} GiB (logs, run dirs, embedded etcd)")


def check_etcd_binary() -> Check:
    path = shutil.which("etcd")
    return Check("etcd binary", True, path or "not on PATH (needed only for the embedded default)",
                 "" if path else "apt-get install etcd-server, or configure [etcd] endpoints")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def run_cluster(args) -> int:
    """`marind doctor --cluster`: the cluster check; exit 1 if a host fails (or none is registered)."""
    from marind.commands.cluster_check import registered_hosts, run_check
    from marind.control.jobs_client import connect
    from marind.doctor_cluster.keys import DEFAULT_BYTES, DEFAULT_TIMEOUT_S
    nbytes = DEFAULT_BYTES if args.bytes is None else args.bytes
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    if nbytes < 4 or timeout < 10:
        raise ValueError("doctor --cluster: --bytes must be >= 4 and --timeout >= 10 (seconds)")
    with connect(args.etcd, args.config) as client:
        hosts = registered_hosts(client)
        if not hosts:
            if args.json:
                print(json.dumps({"schema_version": 1, "ok": False, "request": None, "backend": "",
                                  "bytes": nbytes, "world_size": 0, "failing": [], "hosts": []}))
            else:
                print("No nodes registered: start `marind agent` on each host first.")
            return 1
        report = run_check(client, hosts, nbytes=nbytes, timeout_s=timeout,
                           by=f"{os.environ.get('USER', '?')}@{socket.gethostname()}")
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(cluster_table(report)))
    return 0 if report.ok else 1


def cluster_table(report: Report) -> list[str]:
    """The text of ``doctor --cluster``: a row per host, a summary line, the verdict naming the failing hosts."""
    head = ("NODE", "HOST", "REACHABLE", "LATENCY", "BUS BW", "RESULT")
    cells = [(r.node, r.host or "-", f"{r.reachable_from}/{r.peers}", _ms(r.latency_s), _rate(r.bus_bandwidth),
              "ok" if r.ok else f"FAIL: {r.error}") for r in report.rows]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
             for row in [head, *cells]]
    lines.append("")
    lines.append(f"{report.world_size} of {len(report.rows)} host(s) all-reduced {report.bytes} bytes "
                 f"({report.backend or 'no collective ran'}).")
    lines.append(f"All {len(report.rows)} hosts passed." if report.ok
                 else f"FAILING: {', '.join(report.failing)}")
    return lines


def run(args) -> int:
    if args.cluster:
        return run_cluster(args)
    if args.bytes is not None or args.timeout is not None:
        raise ValueError("doctor: --bytes and --timeout belong to the cluster check: add --cluster")
    from marind.control.config import default_state_dir
    state_dir = args.state_dir or os.environ.get("MARIND_STATE_DIR") or str(default_state_dir())
    checks = check_torch()
    checks.append(check_allreduce())
    checks.append(check_etcd(args.etcd, args.config))
    checks.extend(check_etcd_members(args.etcd, args.config))
    agents = check_agent_state_dirs(args.etcd, args.config)
    if agents is not None:
        checks.append(agents)
    options = json.loads(args.storage_options) if args.storage_options else None
    checks.append(check_store(args.ckpt or f"file://{os.path.join(state_dir, 'ckpt')}", options))
    checks.append(check_etcd_binary())
    checks.append(check_disk(state_dir))
    failed = [c for c in checks if not c.ok]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{'FAIL' if not c.ok else 'WARN' if c.warn else 'PASS'}  {c.name.ljust(width)}  {c.detail}")
            if (not c.ok or c.warn) and c.fix:
                print(f"      {''.ljust(width)}  fix: {c.fix}")
        warned = sum(c.ok and c.warn for c in checks)
        note = f" ({warned} warning{'s' if warned != 1 else ''})" if warned else ""
        print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed{note}." if failed else
              f"\nAll {len(checks)} checks passed{note}.")
    return 1 if failed else 0

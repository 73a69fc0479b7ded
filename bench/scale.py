"""Cluster simulator: N nodes' control plane against a real etcd, and the checkpoint commit at W ranks.

What is real and what is simulated:

* real: one etcd (a private ``LocalEtcd`` per size, started here) and every request made to
  it; per node, marind's own code for registration under a lease and its keep-alive thread
  (``NodeRegistry``, the default TTL), the job watch and its reads (``ChangeWatch``,
  ``list_job_ids``, ``read_job``), the ``node_joined`` event (``Outbox``), the node's job
  record, the job's progress and the node count every ``report_interval`` (what the agent's
  ``RunMonitor.report`` and metrics read and write), the loss of a peer (``NodeLosses`` and
  ``Membership``: the poll, ``decisions.on_node_loss``, the rendezvous' lost marker, the
  claim, the restart of the workers), ``decisions.fence_due`` every tick, and the torchrun's
  side: marind's etcd3 rendezvous handler (``create_handler``, its own client, its lease and
  keep-alive, ``next_rendezvous``, ``num_nodes_waiting`` every 0.5 s) (``bench/scale_node.py``);
  torch's c10d handler on a TCPStore for the comparison; ckpt_store's rank part and commit
  code on a real disk and a real S3 server (SeaweedFS) (``bench/scale_commit.py``);
* simulated: the workers (a stub that steps on every agent tick, stalls when a peer of its
  round goes silent, fails when the agent restarts it); a node's processes (each node's
  agent and torchrun are threads in one of a few worker processes, ``bench/scale_worker.py``,
  and a thread per 4 nodes runs their agent ticks, another their outbox flushes; each
  node still has its own two etcd connections); a silent node (its keep-alives, reports and workers stop at once, its
  connections stay open); a rank's checkpoint part (metadata only: its values, its object
  list and its done marker, no chunk data);
* not here: torchrun's processes and workers, the data network's probes (``liveness``),
  torchft, the doctor's probes, the agent's Prometheus endpoint.

Figures per N (``bench/scale_cluster.py``): ``rendezvous_s`` (from the submit until every
node holds its rank), ``etcd3_round_s`` and ``c10d_rendezvous_s`` (one round of N bare
handlers from a start signal, marind's and torch's, the same harness),
``silent_loss_round_s`` and ``loss_1pct_round_s`` (from the silence until every survivor holds
a rank in a round without the lost), ``etcd_requests_per_node_s`` and
``etcd_bytes_per_node_s`` (steady state with the job running, counted by etcd itself),
``mem_per_node_mb``; at the top, ``exponents``: each figure's least-squares growth exponent
over N (``bench.ckpt_scale.slope``; per-node rates: the exponent of the per-node figure, so
0 is what a linear total has) and ``commit``: per simulated rank count,
``rank0_storage_calls``, ``commit_s``, the list reads of a load, and the same on S3.

    python bench/scale.py                  # 64, 256, 1,024, 2,048 nodes; commit at 1,024 and 4,096 ranks
    python bench/scale.py --nodes 256      # one size
    python bench/scale.py --quick          # 16 nodes, commit at 16 and 64 ranks: the output's shape

The last stdout line is one JSON object (docs/design.md §7); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if not __package__:     # run as a script: bench/ is sys.path[0]; the workers import bench.scale_worker
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ckpt_scale import slope
from marind.testing.procs import exit_on_sigterm

FIGURES = ("rendezvous_s", "etcd3_round_s", "c10d_rendezvous_s", "silent_loss_round_s", "loss_1pct_round_s",
           "etcd_requests_per_node_s", "etcd_bytes_per_node_s", "mem_per_node_mb")
SWEEP = [64, 256, 1024, 2048]
COMMIT_RANKS = [1024, 4096]


def exponents(rows: dict[str, dict], figures=FIGURES, by: str = "nodes") -> dict:
    """Each figure's growth exponent over the sizes it was measured at (None: fewer than two)."""
    out = {}
    for f in figures:
        pts = [(r[by], r[f]) for r in rows.values() if isinstance(r.get(f), (int, float)) and r[f] > 0]
        out[f] = slope([p[0] for p in pts], [p[1] for p in pts]) if len(pts) >= 2 else None
    return out


def _commit_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


_T0 = time.monotonic()


def _log(line: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {line}", file=sys.stderr, flush=True)


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"scale: {what} {text!r}: use comma-separated integers, e.g. 64,256") from None
    if any(x < 2 for x in out):
        raise SystemExit(f"scale: {what} {text!r}: every size must be at least 2")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default=None, help="node counts, comma-separated (default 64,256,1024,2048; empty: the commit only)")
    ap.add_argument("--quick", action="store_true", help="16 nodes, commit at 16 and 64 ranks (checks the shape)")
    ap.add_argument("--commit-ranks", default=None, help="simulated ranks of the commit, comma-separated "
                    "(default 1024,4096; empty: none)")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: one per 32 nodes, at most 64)")
    ap.add_argument("--no-c10d", action="store_true", help="skip torch's c10d round")
    ap.add_argument("--no-s3", action="store_true", help="commit on the local disk only")
    ap.add_argument("--no-loss", action="store_true", help="skip the silent-loss rounds")
    ap.add_argument("--bare-only", action="store_true", help="only the bare handlers' rounds (etcd3, c10d)")
    ap.add_argument("--no-join-events", action="store_true",
                    help="a diagnostic: the nodes write no node_joined event (the agents do)")
    ap.add_argument("--lease-ttl", type=int, default=None, help="the node lease's TTL (default 10, the agent's; "
                    "quick 4)")
    ap.add_argument("--report-interval", type=float, default=None, help="the agent's report interval (default 2.0, "
                    "the agent's; quick 1.0)")
    ap.add_argument("--steady-intervals", type=int, default=None,
                    help="report intervals the steady state is counted over (default 5; quick 3)")
    args = ap.parse_args(argv)
    from bench import scale_cluster, scale_commit

    sizes = [16] if args.quick else (_ints(args.nodes, "--nodes") if args.nodes is not None else SWEEP)
    if args.commit_ranks is not None:
        ranks = _ints(args.commit_ranks, "--commit-ranks") if args.commit_ranks else []
    else:
        ranks = [16, 64] if args.quick else COMMIT_RANKS
    intervals = args.steady_intervals or (3 if args.quick else 5)
    ttl = args.lease_ttl or (4 if args.quick else 10)
    report = args.report_interval or (1.0 if args.quick else 2.0)
    started = time.monotonic()
    result: dict = {"bench": "scale", "mode": "quick" if args.quick else "full", "commit_hash": _commit_hash(),
                    "settings": {"lease_ttl": ttl, "report_interval": report, "rdzv_conf": "torch's defaults"},
                    "steady_intervals": intervals, "nodes": {}}
    for n in sizes:
        _log(f"scale: {n} nodes")
        try:
            row = scale_cluster.measure(n, workers=args.workers, steady_intervals=intervals, report_interval=report,
                                        lease_ttl=ttl, c10d=not args.no_c10d, loss=not args.no_loss,
                                        bare_only=args.bare_only, join_events=not args.no_join_events, log=_log)
        except Exception as exc:  # noqa: BLE001 - a size that breaks is reported, the sweep goes on
            row = {"nodes": n, "error": f"{type(exc).__name__}: {exc}"}
        result["nodes"][str(n)] = row
        print(json.dumps({"size": row}), file=sys.stderr, flush=True)
    result["exponents"] = exponents(result["nodes"])
    result["commit"] = scale_commit.measure(ranks, s3=not args.no_s3, log=_log) if ranks else {}
    commit_rows = {k: {"ranks": v["ranks"], **{f: v[f] for f in ("rank0_storage_calls", "commit_s",
                                                                    "load_list_reads")}}
                   for k, v in result["commit"].items()}
    result["commit_exponents"] = exponents(commit_rows, ("rank0_storage_calls", "commit_s", "load_list_reads"),
                                           by="ranks")
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

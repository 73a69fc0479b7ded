"""`marind submit | status | cancel | logs | nodes | rm` (docs/design.md §5); `events` is ``marind.commands.events``.

A thin layer over ``marind.control.jobs_client``: parse, call, print. Tables and
``--json`` come from the same rows.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import socket
import sys
import time

#: A reason longer than this is cut in the status table (``--json`` has it whole).
REASON_WIDTH = 100


def common_flags(p) -> None:
    """``--etcd --config --state-dir``: where the control plane is (docs/design.md §5)."""
    p.add_argument("--etcd", help="etcd endpoints (default: $MARIND_ETCD, the config file, the local agent's)")
    p.add_argument("--config", help="config file (default $MARIND_CONFIG or /etc/marind/marind.toml)")
    p.add_argument("--state-dir", help="the local agent's state dir, to find its etcd (default $MARIND_STATE_DIR, "
                                       "then ~/.local/state/marind, /var/lib/marind)")



def register(sub) -> None:
    p = sub.add_parser("submit", help="validate a run.toml and submit it as a job")
    p.add_argument("spec", help="path to run.toml")
    p.add_argument("--wait", action="store_true", help="follow the job; exit 4 if it fails")
    p.add_argument("--json", action="store_true", help='print {"id": ...}')
    p.add_argument("--id", help="job id (default: NAME-YYYYmmdd-HHMMSS-xxxx)")
    p.add_argument("--nodes", help="node counts MIN:MAX (or N) in place of the run.toml's job.nodes, checked the "
                                   "same way (a scheduler's allocation: examples/slurm)")
    p.add_argument("--sign-key", help="sign the job with this Ed25519 private key (default: $MARIND_SIGN_KEY, "
                                      "[client] sign_key; agents may run only signed jobs: docs/design.md §2)")
    common_flags(p)
    p.set_defaults(handler=submit)

    p = sub.add_parser("status", help="nodes and jobs")
    p.add_argument("job", nargs="?")
    p.add_argument("--json", action="store_true")
    common_flags(p)
    p.set_defaults(handler=status)

    p = sub.add_parser("nodes", help="registered nodes")
    p.add_argument("--json", action="store_true")
    common_flags(p)
    p.set_defaults(handler=nodes)

    p = sub.add_parser("cancel", help="stop a job on every node")
    p.add_argument("job")
    common_flags(p)
    p.set_defaults(handler=cancel)

    p = sub.add_parser("logs", help="a job's logs on this node")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true",
                   help="print new lines until the job ends; exit 0 if it SUCCEEDED, else 4")
    common_flags(p)
    p.set_defaults(handler=logs)

    p = sub.add_parser("rm", help="delete a finished job's keys from etcd")
    p.add_argument("job")
    p.add_argument("--force", action="store_true", help="also when it is not finished")
    common_flags(p)
    p.set_defaults(handler=rm)


def _client(args):
    from marind.control.config import client_settings
    from marind.control.jobs_client import JobsClient, connect
    return JobsClient(connect(args.etcd, args.config, args.state_dir), owner=client_settings(args.config)["user"])


def checked_spec(path: str, nodes: str | None = None):
    """The spec ``marind submit`` stores: parsed, paths made absolute, checked on this machine.

    A trainer job (``entrypoint = "marind.trainer"``) also gets the trainer's validation
    (sections, presets, batch arithmetic at every world size) and its data path checked;
    any other program's sections are its own and pass through. ``nodes`` replaces
    ``job.nodes`` before any of it, so the world sizes checked are the ones the job will run at.

    Args:
        path: the run.toml.
        nodes: ``"MIN:MAX"`` or ``"N"`` in place of ``job.nodes`` (``--nodes``), or None.

    Returns:
        The core spec to store (a trainer job's sections fully resolved).

    Raises:
        SpecError: an invalid spec, or a working dir / data path missing here (one line; exit 2).
    """
    from marind.core.errors import SpecError
    from marind.core.spec import load_spec, missing_paths, parse_nodes, validate_spec

    spec = load_spec(path)               # relative paths resolve against the run.toml's directory
    if nodes is not None:
        spec = spec.replace(job=dataclasses.replace(spec.job, nodes=parse_nodes(nodes, "--nodes")))
        validate_spec(spec)
    problem = missing_paths(spec)
    if spec.runs_trainer and problem is None:
        from marind.trainer.config import init_from_problem, missing_data, trainer_spec
        typed = trainer_spec(spec)
        problem = missing_data(typed) or init_from_problem(typed)
        spec = typed.core()
    if problem:
        raise SpecError(problem)
    return spec


def submit(args) -> int:
    from marind.control.config import sign_key_setting
    from marind.core.errors import JobFailed

    spec = checked_spec(args.spec, args.nodes)       # validates before anything touches etcd (exit 2)
    jc = _client(args)
    job = jc.submit(spec.to_dict(), spec.job.name, args.id, sign_key=sign_key_setting(args.sign_key, args.config))
    if not args.wait:
        if args.json:
            print(json.dumps({"id": job}))
        else:
            print(f"Submitted job {job}.\n  follow: marind status {job}\n  logs:   marind logs {job} -f\n"
                  f"  cancel: marind cancel {job}")
            print(job)
        return 0
    if not args.json:
        print(f"Submitted job {job}; following (Ctrl-C stops following, not the job).")

    def show(row):
        if not args.json:
            print(f"{time.strftime('%H:%M:%S')} {row['state']:<10} step {step_cell(row['step'], row['target_steps'])} "
                  f"restarts {row['restarts']}", flush=True)

    row = jc.wait(job, on_change=show)
    if args.json:
        print(json.dumps({"id": job, "state": row["state"]}))
    else:
        print(f"Job {job} {row['state']}: {row['reason']}")
        print(job)
    if row["state"] != "SUCCEEDED":
        raise JobFailed(f"job {job} {row['state']}: {row['reason']}")
    return 0


def step_cell(step: int | None, target: int | None) -> str:
    """``100/1000``, or ``100`` for a program that declares no step count (``-`` before any step)."""
    shown = "-" if step is None else str(step)
    return f"{shown}/{target}" if target is not None else shown


def _fmt(value, digits=None) -> str:
    if value is None:
        return "-"
    if digits is not None and isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _print_nodes(nodes: list[dict]) -> None:
    """The node table, then a line for each node that says what is wrong with it (a full state dir)."""
    from marind.control.jobs_client import node_issues

    if not nodes:
        print("No nodes.")
        return
    print(_table(["NODE", "HOST", "SLOTS", "VERSION", "UP"],
                 [[n["node"], n.get("host", "-"), _fmt(n.get("slots")), _fmt(n.get("version")),
                   f"{time.time() - float(n.get('started_at', time.time())):.0f}s"] for n in nodes]))
    for line in node_issues({n["node"]: n for n in nodes}).values():
        print(line)


def status(args) -> int:
    doc = _client(args).status_document(args.job)
    if args.json:
        print(json.dumps(doc, sort_keys=True))
        return 0
    _print_nodes(doc["nodes"])
    print()
    if not doc["jobs"]:
        print("No jobs.")
        return 0
    print(_table(["JOB", "STATE", "NODES", "WORLD", "STEP", "LOSS", "TOK/S", "CKPT", "RESTARTS", "REASON"],
                 [[j["id"], j["state"], _fmt(len(j["nodes"])), _fmt(j["world_size"]), _fmt(j["step"]),
                   _fmt(j["loss"], 4), _fmt(j["tokens_per_s"], 0), _fmt(j["last_checkpoint_step"]),
                   _fmt(j["restarts"]), _reason_cell(j)] for j in doc["jobs"]]))
    for j in doc["jobs"]:
        if j.get("torchft"):
            _print_replica_groups(j["id"], j["torchft"])
        for s in j.get("stragglers") or ():
            print(f"{j['id']}: straggler {s['node']} rank {s['rank']}: {_fmt(s.get('compute_s'), 3)}s of compute "
                  "per step, slower than the others (marind events for why)")
    for line in fix_lines(doc["jobs"]):
        print(line)
    if args.job:
        _print_goodput(args, args.job)
    return 0


def _print_goodput(args, job: str) -> None:
    """`status JOB`: the goodput ledger's figure and its top causes (docs/design.md §11)."""
    from marind.control.goodput_ledger import summary_line
    from marind.control.job_history import read_ledger

    print(f"\n{job}: {summary_line(read_ledger(_client(args).client, job))}")


def fix_lines(jobs: list[dict]) -> list[str]:
    """Below the table, for each RESTARTING or FAILED job whose last failure has a known cause:
    ``JOB: fix: ...`` (the REASON cell is cut; ``status --json`` has ``last_error`` whole)."""
    from marind.control.jobs_client import REASON_STATES

    out = []
    for j in jobs:
        err = j.get("last_error")
        if j["state"] in REASON_STATES and isinstance(err, dict) and err.get("fix"):
            out.append(f"{j['id']}: {err.get('cause', 'cause')}: fix: {err['fix']}")
    return ["", *out] if out else []


def _reason_cell(job: dict) -> str:
    """The REASON column: RESTARTING and FAILED jobs only, cut to ``REASON_WIDTH``."""
    from marind.control.jobs_client import REASON_STATES

    reason = job.get("reason") or ""
    if job["state"] not in REASON_STATES or not reason:
        return "-"
    return reason if len(reason) <= REASON_WIDTH else reason[:REASON_WIDTH - 3] + "..."


def _print_replica_groups(job: str, ft: dict) -> None:
    lh = ft.get("lighthouse") or {}
    print(f"\n{job}: torchft replica groups; lighthouse {lh.get('address', '-')} on {lh.get('node', '-')} "
          f"(epoch {_fmt(lh.get('epoch'))}), quorum {_fmt(ft.get('quorum_id'))} with "
          f"{_fmt(ft.get('participants'))} participating")
    print(_table(["GROUP", "MEMBER", "NODE", "STATE", "STEP", "PARTICIPANTS", "QUORUM"],
                 [[str(g["slot"]), _fmt(g.get("member")), _fmt(g["node"]), _fmt(g["state"]), _fmt(g["step"]),
                   _fmt(g["participants"]), _fmt(g["quorum_id"])] for g in ft["groups"]]))


def nodes(args) -> int:
    rows = _client(args).nodes()
    if args.json:
        print(json.dumps({"schema_version": 1, "nodes": rows}, sort_keys=True))
    else:
        _print_nodes(rows)
    return 0


def cancel(args) -> int:
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    state = _client(args).cancel(args.job, by)
    print(f"Job {args.job} {state}." if state != "CANCELLED" else f"Cancelled job {args.job}; "
          "its workers stop within seconds on every node.")
    return 0


def rm(args) -> int:
    _client(args).remove(args.job, force=args.force)
    print(f"Removed job {args.job}.")
    return 0


def logs(args) -> int:
    from marind.control.jobs_client import local_log_files
    from marind.core.errors import NotFound

    files = local_log_files(args.job, args.state_dir)
    if not files:
        raise NotFound(f"no logs of job {args.job} on this node: run `marind logs` on a node that ran it "
                       "(see `marind status`), or pass --state-dir")
    offsets = {p: 0 for p in files}
    _copy_new(offsets)
    if not args.follow:
        return 0
    return _follow_logs(args, offsets)


def _copy_new(offsets: dict) -> None:
    """Write what each file gained since its offset to stdout; move the offsets."""
    for path, offset in offsets.items():
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size < offset:
            offset = 0          # truncated: from the start
        if size > offset:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(size - offset)
            sys.stdout.write(data.decode(errors="replace"))
            offsets[path] = offset + len(data)
    sys.stdout.flush()


def _follow_logs(args, offsets: dict, poll: float = 0.5, state_every: float = 1.0) -> int:
    """`logs -f`: new lines until the job is terminal; exit like `submit --wait` (0 SUCCEEDED, else 4).

    Without a reachable control plane it follows until Ctrl-C (said once on stderr).
    """
    from marind.control.lifecycle import JobState
    from marind.core.errors import ControlPlaneUnavailable, JobFailed

    try:
        jc = _client(args)
    except ControlPlaneUnavailable as exc:
        sys.stderr.write(f"marind: {exc}; following until Ctrl-C (the job's end cannot be seen)\n")
        jc = None
    last_look = 0.0
    try:
        while True:
            _copy_new(offsets)
            if jc is not None and time.monotonic() - last_look >= state_every:
                last_look = time.monotonic()
                try:
                    state = jc.state(args.job)
                except ControlPlaneUnavailable:
                    continue
                if state.is_terminal():
                    time.sleep(poll)          # the last lines the workers wrote on the way out
                    _copy_new(offsets)
                    if state != JobState.SUCCEEDED:
                        raise JobFailed(f"job {args.job} {state.value}: see `marind events {args.job}`")
                    return 0
            time.sleep(poll)
    except KeyboardInterrupt:
        return 0

"""`marind events JOB [-f] [--json]`: the job's event ring (docs/design.md §2, §5).

One line per event, oldest first: time (UTC), node, kind, details
(``key=value``; the reason last). ``-f`` follows new events until the job is
terminal and exits like ``submit --wait`` (0 SUCCEEDED, 4 otherwise);
``--json`` prints one JSON object per event and line.
"""

from __future__ import annotations

import json
import time

#: Detail keys shown last, in this order (the long, human ones).
_LAST = ("reason", "stack_dump", "log")


def format_detail(detail: object) -> str:
    """An event's detail as ``key=value`` pairs, the reason last (a ``fix`` the reason ends with is not repeated).

    Args:
        detail: the event's ``detail`` (a dict, a string, or anything JSON).

    Returns:
        One line.
    """
    if not isinstance(detail, dict):
        return "" if detail in (None, "") else str(detail)
    keys = [k for k in sorted(detail) if k not in _LAST] + [k for k in _LAST if k in detail]
    parts = []
    for key in keys:
        value = detail[key]
        if key == "fix" and isinstance(value, str) and str(detail.get("reason", "")).endswith(value):
            continue            # a cause's reason ends with its fix (marind.control.failure_causes)
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        parts.append(f"{key}={text}")
    return " ".join(parts).replace("\n", " ")


def format_event(event: dict) -> str:
    """One event as a line: ``2026-01-02T03:04:05Z  node  kind  details``.

    Args:
        event: ``{at, kind, node, detail, seq}`` as ``JobsClient.events`` returns it.

    Returns:
        The line (no newline).
    """
    try:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(event.get("at") or 0.0)))
    except (TypeError, ValueError, OverflowError):
        when = "-"
    node = str(event.get("node") or "-")
    kind = str(event.get("kind") or "-")
    return f"{when}  {node:<12} {kind:<20} {format_detail(event.get('detail'))}".rstrip()


def register(sub) -> None:
    from marind.commands.jobs import common_flags

    p = sub.add_parser("events", help="a job's events: restarts and their reasons, hangs, node loss, checkpoints",
                       description="The job's event ring from etcd, oldest first: time, node, kind, details.")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true",
                   help="print new events until the job ends; exit 0 if it SUCCEEDED, else 4")
    p.add_argument("--json", action="store_true", help='one object per line: {"seq", "at", "node", "kind", "detail"}; '
                   'without -f, a last line of kind "ledger": the goodput ledger')
    common_flags(p)
    p.set_defaults(handler=events)


def _show_ledger(args, jc, rows: list[dict] | None) -> None:
    """``--json`` without ``-f``: a last line ``{"kind": "ledger", "detail": LEDGER, ...}`` (docs/design.md §11)."""
    if not args.json:
        return
    import time

    from marind.control.job_history import read_ledger

    ledger = read_ledger(jc.client, args.job, rows)
    print(json.dumps({"seq": None, "at": time.time(), "node": None, "kind": "ledger", "detail": ledger},
                     sort_keys=True), flush=True)


def events(args) -> int:
    from marind.control.jobs_client import JobsClient, connect
    from marind.control.lifecycle import JobState
    from marind.core.errors import JobFailed

    jc = JobsClient(connect(args.etcd, args.config, args.state_dir))

    def show(event: dict) -> None:
        if args.json:
            print(json.dumps({k: event.get(k) for k in ("seq", "at", "node", "kind", "detail")}, sort_keys=True),
                  flush=True)
        else:
            print(format_event(event), flush=True)

    if not args.follow:
        rows = jc.events(args.job)
        if not rows and not args.json:
            print(f"No events of job {args.job}.")
        for event in rows:
            show(event)
        _show_ledger(args, jc, rows)
        return 0
    state = jc.follow_events(args.job, show)
    if state != JobState.SUCCEEDED:
        raise JobFailed(f"job {args.job} {state.value}: see `marind status {args.job}`")
    return 0

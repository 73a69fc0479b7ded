"""Render the faults table (docs/perf.md) from the rows the chaos scenarios wrote.

    MARIND_FAULTS_TABLE=build/faults.jsonl make chaos      # each scenario adds its row
    python tools/faults_table.py build/faults.jsonl         # the markdown table, a row per scenario

A row (``marind.testing.history.fault_row``): the scenario, its outcome, restarts, the time the
faults cost (the run's span from first to last step less the fault-free run's), steps lost
(steps run again), committed checkpoints lost and history-invariant violations (both must be 0);
"training again": seconds from the fault until the job stepped again, where the scenario measured it
(the half-working networks', issue 30's floor: a lease TTL + 10 s), "-" elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys


def render(rows: list[dict]) -> str:
    head = ("| scenario | outcome | restarts | time lost, s | training again, s | steps lost | checkpoints lost "
            "| violations |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f}"
        again = "-" if r.get("again_s") is None else f"{r['again_s']:.1f}"
        lines.append(f"| {r['scenario']} | {r.get('state')} | {r.get('restarts', 0)} | {rec} | {again} | "
                     f"{r.get('steps_lost', 0)} | {r.get('checkpoints_lost', 0)} | {r.get('violations', 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", help="the JSON-lines file the scenarios wrote (MARIND_FAULTS_TABLE)")
    args = parser.parse_args(argv)
    try:
        with open(args.rows) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"Error: cannot read {args.rows}: {exc} (run `MARIND_FAULTS_TABLE={args.rows} make chaos` first)\n")
        return 2
    sys.stdout.write(render(rows) + "\n")
    bad = [r["scenario"] for r in rows if r.get("violations") or r.get("checkpoints_lost")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

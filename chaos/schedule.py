"""Run an injector again and again at failure times drawn from a seed.

    python chaos/schedule.py --job JOB [--etcd URL] [--seed N] --every 60 [--fixed]
        [--duration 600] [--max-actions N] [--min-gap S] INJECTOR [INJECTOR_ARGS...]

``INJECTOR`` is a name in chaos/ (``kill_random_rank``, ``hang_rank``, ...);
it is run with ``--job/--etcd/--prefix`` passed on, a ``--seed`` drawn for
each run, then ``INJECTOR_ARGS``. Failure times are exponential
inter-arrivals with mean ``--every`` seconds (a Poisson process), or every
``--every`` seconds with ``--fixed``, within ``--duration`` seconds and at
most ``--max-actions`` runs. The whole schedule is logged before the
first wait, and each wait really lasts until the drawn time (a run that
overruns the next time delays it, and the lateness is logged). The
injectors' action lines are passed through on stdout, each with the
``draw`` it belongs to. Exit 0 if any run acted, 1 if none did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from marind.core.log import get_logger
from marind.testing.chaos.common import EXIT_ACTED, EXIT_NOTHING, base_parser, run, seeded_rng
from marind.testing.chaos.schedule import Draw, draw_schedule

log = get_logger("chaos.schedule")
CHAOS_DIR = Path(__file__).resolve().parent


def injector_command(name: str, args, draw: Draw, extra: list[str]) -> list[str]:
    script = CHAOS_DIR / (name if name.endswith(".py") else f"{name}.py")
    if not script.is_file() or script.name.startswith("_") or script.name == "schedule.py":
        raise ValueError(f"unknown injector {name!r}: use one of "
                         + ", ".join(sorted(p.stem for p in CHAOS_DIR.glob("[a-z]*.py")
                                            if p.name != "schedule.py")))
    cmd = [sys.executable, str(script)]
    for flag, value in (("--job", args.job), ("--etcd", args.etcd), ("--prefix", args.prefix)):
        if value:
            cmd += [flag, value]
    return cmd + ["--seed", str(draw.seed), *extra]


def run_draw(cmd: list[str], draw: Draw, timeout: float) -> int:
    """Run one injector, pass on its action lines tagged with the draw; its exit code."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        log.warning("injector_timed_out", draw=draw.index, timeout=timeout)
        rc = 124
    for line in out.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            sys.stderr.write(line + "\n")
            continue
        record["draw"] = draw.index
        sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0], job_required=False)
    parser.add_argument("--every", type=float, required=True,
                        help="mean seconds between failures (exactly this with --fixed)")
    parser.add_argument("--fixed", action="store_true", help="fixed, not exponential, intervals")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds the schedule spans (default 600)")
    parser.add_argument("--max-actions", type=int, help="at most this many injector runs")
    parser.add_argument("--min-gap", type=float, default=0.0, help="shortest gap between failures")
    parser.add_argument("--injector-timeout", type=float, default=600.0,
                        help="seconds one injector run may take (default 600)")
    parser.add_argument("injector", help="injector name in chaos/, e.g. kill_random_rank")
    parser.add_argument("injector_args", nargs="...", help="passed on to the injector")
    args = parser.parse_args(argv)
    extra = list(args.injector_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    seeded_rng(args)
    draws = draw_schedule(args.seed, args.every, args.duration, max_actions=args.max_actions,
                          fixed=args.fixed, min_gap=args.min_gap)
    commands = [injector_command(args.injector, args, d, extra) for d in draws]
    start, start_wall = time.monotonic(), time.time()
    log.info("schedule", seed=args.seed, injector=args.injector, every=args.every,
             fixed=args.fixed, duration=args.duration, start=round(start_wall, 3),
             draws=[asdict(d) for d in draws])
    acted = 0
    for draw, cmd in zip(draws, commands):
        delay = start + draw.at - time.monotonic()
        log.info("waiting", draw=draw.index, at=draw.at, wait_s=round(max(delay, 0.0), 3))
        if delay > 0:
            time.sleep(delay)
        else:
            log.warning("draw_late", draw=draw.index, late_s=round(-delay, 3))
        rc = run_draw(cmd, draw, args.injector_timeout)
        log.info("injector_done", draw=draw.index, rc=rc,
                 elapsed_s=round(time.monotonic() - start, 3))
        acted += rc == EXIT_ACTED
    log.info("schedule_done", draws=len(draws), acted=acted)
    return EXIT_ACTED if acted else EXIT_NOTHING


if __name__ == "__main__":
    sys.exit(run(main))

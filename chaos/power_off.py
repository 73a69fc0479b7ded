"""Power a host of the multi-host bed off: both links cut and every process SIGSTOPped at once.

    python chaos/power_off.py [--bed DIR] [--host H] [--seed N] [--forever | --back-after S]

The host's peers see silence (no FIN, no RST), as from a machine that lost
power. ``--forever`` then SIGKILLs every process of the host (its links stay
cut); ``--back-after S`` restores the links after S seconds and continues
the processes (a machine that comes back with stale processes; SIGTERM
brings it back early); with neither, the host stays off until the bed is
torn down. The bed is ``--bed`` (its directory) or ``MARIND_BED``; the host
``--host`` or a seeded choice. One JSON line per action (``power_off``, then
``kill`` or ``power_on``); exit 0 if a host was powered off, 1 if none matched.
"""

from __future__ import annotations

import argparse
import sys

from marind.testing.chaos.common import run
from marind.testing.chaos.host_faults import add_bed_args, load_bed, pick_host, power_off


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_bed_args(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--forever", action="store_true", help="then SIGKILL every process of the host")
    mode.add_argument("--back-after", type=float, metavar="S",
                      help="restore the links and continue the processes after S seconds")
    args = parser.parse_args(argv)
    if args.back_after is not None and args.back_after < 0:
        raise ValueError("--back-after must be >= 0")
    plan = load_bed(args.bed)
    host = pick_host(plan, args.host, args)
    power_off(plan, host, forever=args.forever, back_after=args.back_after, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

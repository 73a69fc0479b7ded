"""Partition a host of the multi-host bed: cut its control, data or both links, then heal.

    python chaos/partition.py [--bed DIR] [--host H] [--seed N] --net control|data|both --seconds S
        [--keep-carrier]

The cut links drop every frame silently (peers see silence, the host sees
no carrier; with ``--keep-carrier`` the bridge drops the host's frames while
both link ends keep their carrier, a switch dropping traffic); after S
seconds (or at SIGTERM/SIGINT) they are restored. The
host's processes keep running. The bed is ``--bed`` (its directory) or
``MARIND_BED``; the host ``--host`` or a seeded choice. One JSON line per
action (``partition``, ``heal``); exit 0 if a host was cut, 1 if none matched.
"""

from __future__ import annotations

import argparse
import sys

from marind.testing.chaos.common import run
from marind.testing.chaos.host_faults import add_bed_args, load_bed, partition, pick_host
from marind.testing.hosts_plan import nets_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_bed_args(parser)
    parser.add_argument("--net", required=True, choices=["control", "data", "both"],
                        help="which network to cut")
    parser.add_argument("--seconds", type=float, required=True, help="how long the cut lasts")
    parser.add_argument("--keep-carrier", action="store_true",
                        help="drop the host's frames at the bridge, links kept up (a switch dropping traffic)")
    args = parser.parse_args(argv)
    if args.seconds < 0:
        raise ValueError("--seconds must be >= 0")
    plan = load_bed(args.bed)
    host = pick_host(plan, args.host, args)
    partition(plan, host, nets_of(args.net), args.seconds, seed=args.seed, keep_carrier=args.keep_carrier)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

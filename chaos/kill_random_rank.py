"""SIGKILL a random live worker of a job: the "a GPU process died mid-run" fault.

    python chaos/kill_random_rank.py --job JOB [--etcd URL] [--seed N]
        [--signal KILL] [--count 1] [--interval 0] [--rank R] [--node NODE]
        [--after-step S] [--wait SECONDS] [--during-save [--url URL] [--storage-options JSON]]

Targets are the workers that the job's etcd records place on this host,
checked to be alive descendants of their torchrun. ``--count N`` with
``--interval 0`` signals N distinct workers at once; with an interval it
signals one, waits, looks again (the job may have restarted) and repeats.
``--during-save`` first waits (up to ``--wait``) for a checkpoint save to
start under the job's checkpoint url, so the kill lands mid-upload.
One JSON line per signal; exit 0 if any was sent, 1 if none.
"""

from __future__ import annotations

import os
import sys
import time

from marind.core.log import get_logger
from marind.testing.chaos.ckpt import add_root_args, add_save_wait_args, resolve_root, wait_for_save
from marind.testing.chaos.common import (
    NothingToDo,
    add_wait_args,
    base_parser,
    connect,
    emit,
    parse_signal,
    run,
    seeded_rng,
    wait_for_step,
    wait_until,
)
from marind.testing.chaos.targets import find_workers

log = get_logger("chaos.kill_random_rank")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0])
    parser.add_argument("--signal", default="KILL", help="signal name or number (default KILL)")
    parser.add_argument("--count", type=int, default=1, help="how many workers to signal")
    parser.add_argument("--interval", type=float, default=0.0,
                        help="seconds between signals; 0 signals --count distinct workers at once")
    parser.add_argument("--rank", type=int, help="signal this global rank instead of a random one")
    parser.add_argument("--node", help="choose only among this node's workers")
    add_wait_args(parser)
    add_save_wait_args(parser, what="signal")
    add_root_args(parser)
    args = parser.parse_args(argv)
    if args.count < 1:
        raise ValueError("--count must be >= 1")
    sig = parse_signal(args.signal)
    rng = seeded_rng(args)
    client = connect(args)
    wait_for_step(client, args.job, args.after_step, timeout=args.wait or 3600.0)
    extra = {}
    if args.during_save:
        fs, root, url = resolve_root(args, client)
        extra["during_save_step"] = wait_for_save(fs, root, url, args.wait or 3600.0, log)

    signalled: set[int] = set()
    sent = 0
    while sent < args.count:
        batch = args.count - sent if args.interval == 0 else 1

        def candidates():
            return find_workers(client, args.job, rank=args.rank, node=args.node, exclude=signalled)

        found = wait_until(candidates, timeout=args.wait, interval=0.2) or []
        if not found:
            if sent == 0:
                raise NothingToDo(f"no live worker of job {args.job} on this host"
                                  + (f" with rank {args.rank}" if args.rank is not None else ""))
            log.warning("no_more_targets", job=args.job, sent=sent, wanted=args.count)
            break
        chosen = rng.sample(found, min(batch, len(found)))
        for worker in sorted(chosen, key=lambda w: w.rank):
            try:
                os.kill(worker.pid, sig)
            except ProcessLookupError:
                log.warning("target_gone", pid=worker.pid, rank=worker.rank)
                continue
            signalled.add(worker.pid)
            sent += 1
            emit("kill", target=f"{args.job}/rank-{worker.rank}", pid=worker.pid, rank=worker.rank,
                 node=worker.node, signal=sig.name, seed=args.seed, **extra)
        if sent < args.count and args.interval > 0:
            time.sleep(args.interval)
    if sent == 0:
        raise NothingToDo(f"every chosen worker of job {args.job} exited before the signal")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

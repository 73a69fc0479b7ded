"""SIGSTOP a worker of a job: a rank stuck in a collective or a driver call.

    python chaos/hang_rank.py --job JOB [--etcd URL] [--seed N] [--rank R] [--node NODE]
        [--seconds S] [--after-step S] [--wait SECONDS]

With ``--seconds S`` the worker is continued (SIGCONT) after S seconds,
unless it was killed meanwhile (by the agent's hang detection, say);
without it the worker stays stopped for good. Interrupting the injector
(SIGINT/SIGTERM) during the hang continues the worker first. One JSON
line per action (``hang``, then ``resume``); exit 0 if a worker was
stopped, 1 if none matched.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

from marind.core.log import get_logger
from marind.testing.chaos.common import (
    NothingToDo,
    add_wait_args,
    base_parser,
    connect,
    emit,
    run,
    seeded_rng,
    wait_for_step,
    wait_until,
)
from marind.testing.chaos.targets import find_workers

log = get_logger("chaos.hang_rank")


def _same_process(pid: int, create_time: float) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if proc.create_time() != create_time or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0])
    parser.add_argument("--rank", type=int, help="stop this global rank (default: a seeded choice)")
    parser.add_argument("--node", help="choose only among this node's workers")
    parser.add_argument("--seconds", type=float,
                        help="continue the worker after this long (default: stopped for good)")
    add_wait_args(parser)
    args = parser.parse_args(argv)
    if args.seconds is not None and args.seconds < 0:
        raise ValueError("--seconds must be >= 0")
    rng = seeded_rng(args)
    client = connect(args)
    wait_for_step(client, args.job, args.after_step, timeout=args.wait or 3600.0)
    found = wait_until(lambda: find_workers(client, args.job, rank=args.rank, node=args.node,
                                            exclude=set()), timeout=args.wait, interval=0.2)
    if not found:
        raise NothingToDo(f"no live worker of job {args.job} on this host"
                          + (f" with rank {args.rank}" if args.rank is not None else ""))
    worker = rng.choice(found)
    try:
        created = psutil.Process(worker.pid).create_time()
        os.kill(worker.pid, signal.SIGSTOP)
    except (ProcessLookupError, psutil.NoSuchProcess):
        raise NothingToDo(f"worker rank {worker.rank} (pid {worker.pid}) exited before the signal") from None
    target = f"{args.job}/rank-{worker.rank}"
    emit("hang", target=target, pid=worker.pid, rank=worker.rank, node=worker.node,
         signal="SIGSTOP", seconds=args.seconds, seed=args.seed)
    if args.seconds is None:
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        log.info("interrupted_resuming_early", pid=worker.pid)
    finally:
        proc = _same_process(worker.pid, created)
        if proc is None:
            log.info("target_gone_before_resume", pid=worker.pid, rank=worker.rank)
        else:
            proc.send_signal(signal.SIGCONT)
            emit("resume", target=target, pid=worker.pid, rank=worker.rank, node=worker.node,
                 signal="SIGCONT", seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

"""SIGKILL a node's agent and its whole process tree: the "we lost a node" fault.

    python chaos/kill_node.py --job JOB [--etcd URL] [--seed N] [--node NODE]
        [--with-etcd] [--after-step S] [--wait SECONDS]

The node is ``--node`` or a seeded choice among the job's nodes on this
host. Its agent pid comes from the job's node record (``agent_pid``, else
the node record's ``pid``) and is checked against the node's
registration time and its torchrun's parentage. The whole tree (agent,
torchrun, workers, anything else below the agent) is first frozen with
SIGSTOP, so nothing can respawn a child, then SIGKILLed. An etcd server
in the tree (the agent's embedded one) is spared unless ``--with-etcd``:
the other nodes need it to notice the loss. One JSON line; exit 0 if a
node was killed, 1 if none matched.
"""

from __future__ import annotations

import os
import signal
import sys
from urllib.parse import urlsplit

import psutil

from marind.core.log import get_logger
from marind.testing.chaos.common import (
    NothingToDo,
    add_wait_args,
    base_parser,
    connect,
    emit,
    resolve_etcd,
    run,
    seeded_rng,
    wait_for_step,
    wait_until,
)
from marind.testing.chaos.servers import listens_on
from marind.testing.chaos.targets import (
    NodeTarget,
    agent_is_genuine,
    job_node_records,
    live_process,
    local_nodes,
    node_records,
    this_host_names,
)

log = get_logger("chaos.kill_node")


def find_nodes(client, job: str, node: str | None) -> list[NodeTarget]:
    targets = local_nodes(job_node_records(client, job), node_records(client), this_host_names())
    return [t for t in targets if (node is None or t.node == node) and agent_is_genuine(t)]


def process_tree(target: NodeTarget, spare_port: int | None) -> list[psutil.Process]:
    """Agent, everything below it, and the record's torchrun/workers (if still below it)."""
    agent = live_process(target.agent_pid)
    if agent is None:
        return []
    tree = {agent.pid: agent}
    try:
        for child in agent.children(recursive=True):
            tree[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    if spare_port:
        spared = {p.pid for p in tree.values() if listens_on(p, spare_port)}
        for pid in list(spared):
            try:
                spared |= {c.pid for c in tree[pid].children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for pid in spared:
            log.info("sparing_etcd", pid=pid, port=spare_port)
            tree.pop(pid, None)
    tree.pop(os.getpid(), None)
    return list(tree.values())


def kill_tree(procs: list[psutil.Process]) -> list[int]:
    """SIGSTOP every process (no respawns), then SIGKILL every one; the pids signalled."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    wait_until(lambda: all(live_process(p.pid) is None for p in procs), timeout=5.0, interval=0.05)
    return sorted(p.pid for p in procs)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0])
    parser.add_argument("--node", help="kill this node (default: a seeded choice)")
    parser.add_argument("--with-etcd", action="store_true",
                        help="also kill an etcd server running under the agent")
    add_wait_args(parser)
    args = parser.parse_args(argv)
    rng = seeded_rng(args)
    client = connect(args)
    wait_for_step(client, args.job, args.after_step, timeout=args.wait or 3600.0)
    found = wait_until(lambda: find_nodes(client, args.job, args.node), timeout=args.wait,
                       interval=0.2)
    if not found:
        raise NothingToDo(f"no live agent of job {args.job} on this host"
                          + (f" for node {args.node}" if args.node else ""))
    target = rng.choice(found)
    port = None if args.with_etcd else urlsplit(_first_endpoint(resolve_etcd(args.etcd))).port
    tree = process_tree(target, port)
    if not tree:
        raise NothingToDo(f"agent of node {target.node} exited before the kill")
    killed = kill_tree(tree)
    emit("kill_node", target=target.node, pid=target.agent_pid, node=target.node,
         signal="SIGKILL", killed=killed, torchrun_pid=target.torchrun_pid, seed=args.seed)
    return 0


def _first_endpoint(spec: str) -> str:
    first = spec.split(",")[0].strip()
    return first if "://" in first else "http://" + first


if __name__ == "__main__":
    sys.exit(run(main))

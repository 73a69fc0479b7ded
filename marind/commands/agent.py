"""`marind agent`: the per-node daemon (docs/design.md §5)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("agent", help="run the per-node daemon (one per node, under systemd)",
                       description="Register this node in etcd, run and supervise its jobs' torchruns. "
                                   "Without etcd endpoints it starts an embedded etcd under --state-dir.")
    p.add_argument("--config", help="config file (default $MARIND_CONFIG, else /etc/marind/marind.toml if present)")
    p.add_argument("--node", help="node name (default: the host name)")
    p.add_argument("--etcd", help="etcd endpoints, e.g. http://10.0.0.1:2379,http://10.0.0.2:2379")
    p.add_argument("--state-dir", help="run dirs, logs, embedded etcd (default /var/lib/marind or ~/.local/state/marind)")
    p.add_argument("--slots", type=int, help="worker processes this node runs at most (default: GPUs, else CPUs)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port on 127.0.0.1 (0 = off, -1 = any free port)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from marind.agent.daemon import Agent
    from marind.control.config import load_config
    from marind.core.log import configure_logging

    configure_logging()
    config = load_config(args.config, flags={"node": args.node, "etcd": args.etcd,
                                             "state_dir": args.state_dir, "slots": args.slots,
                                             "metrics_port": args.metrics_port})
    agent = Agent(config)
    agent.install_signal_handlers()
    return agent.run()

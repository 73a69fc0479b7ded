"""Stop etcd for a while and start it again on the same data dir: a flaky control plane.

    python chaos/etcd_outage.py [--job JOB] [--etcd URL] [--state FILE] [--seconds 10]

The server is the one ``--state`` describes (a state file written by
``marind.control.local_etcd.LocalEtcd``; default ``$MARIND_ETCD_STATE``), else the
process of this host listening on the etcd endpoint. It is stopped
(SIGTERM, as a crash-free shutdown would; then SIGKILL), kept down for
``--seconds`` and started again with its own command line, so the same
ports and data dir. With ``--job`` the job must exist in etcd first.
Lines: ``stop_server``, ``start_server``; exit 0 if etcd was cycled,
1 if no etcd server of this host was found.
"""

from __future__ import annotations

import sys

from marind.testing.chaos.common import base_parser, connect, resolve_etcd, run, seeded_rng
from marind.testing.chaos.outage import add_outage_args, find_server, outage, require_job


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0], job_required=False)
    add_outage_args(parser, env_var="MARIND_ETCD_STATE")
    args = parser.parse_args(argv)
    seeded_rng(args)
    if args.state and not args.etcd:
        state = find_server(args.state, None, kind="etcd")
        args.etcd = state.endpoint            # the server the state file names is the target
    endpoint = resolve_etcd(args.etcd).split(",")[0].strip()
    endpoint = endpoint if "://" in endpoint else "http://" + endpoint
    if args.job:
        require_job(connect(args), args.job)
    state = find_server(args.state, endpoint, kind="etcd",
                        health_url=f"{endpoint}/health" if endpoint else None,
                        health_expect='"true"')
    outage(state, args.seconds, ready_timeout=args.ready_timeout, job=args.job, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

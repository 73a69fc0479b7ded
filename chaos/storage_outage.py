"""Stop the S3 server for a while and start it again: a storage outage.

    python chaos/storage_outage.py [--job JOB] [--state FILE | --endpoint URL] [--seconds 10]
        [--during-save [--url CKPT_URL] [--storage-options JSON] [--wait SECONDS]]

The server is the one ``--state`` describes (``marind.testing.s3_server``
writes one; default ``$MARIND_S3_STATE``), else the process of this host
listening on ``--endpoint``. With ``--during-save`` the outage starts the
moment a new checkpoint save is seen in progress under the job's
checkpoint url (``--url``, default the job spec's ``checkpoint.url``): a
step directory without ``manifest.json`` newer than the last committed
step. Lines: ``stop_server``, ``start_server``; exit 0 if the server was
cycled, 1 if it or a save (within ``--wait``) was not found.
"""

from __future__ import annotations

import sys

from marind.core.log import get_logger
from marind.testing.chaos.ckpt import add_root_args, add_save_wait_args, resolve_root, wait_for_save
from marind.testing.chaos.common import base_parser, connect, run, seeded_rng
from marind.testing.chaos.outage import add_outage_args, find_server, outage, require_job

log = get_logger("chaos.storage_outage")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0], job_required=False)
    add_outage_args(parser, env_var="MARIND_S3_STATE")
    parser.add_argument("--endpoint", help="S3 endpoint, e.g. http://127.0.0.1:8333 (without --state)")
    add_save_wait_args(parser, what="start the outage")
    add_root_args(parser)
    parser.add_argument("--wait", type=float, default=300.0,
                        help="with --during-save: seconds to wait for a save (default 300)")
    args = parser.parse_args(argv)
    seeded_rng(args)
    client = connect(args) if args.job else None
    if args.job:
        require_job(client, args.job)
    state = find_server(args.state, args.endpoint, kind="s3")
    extra = {}
    if args.during_save:
        fs, root, url = resolve_root(args, client, s3_endpoint=state.endpoint)
        extra = {"during_save_step": wait_for_save(fs, root, url, args.wait, log)}
    outage(state, args.seconds, ready_timeout=args.ready_timeout, job=args.job, seed=args.seed,
           **extra)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

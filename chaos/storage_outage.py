"""Stop the S3 server for a while and start it again: a storage outage.

    python chaos/storage_outage.py [--job JOB] [--state FILE | --endpoint URL] [--seconds 10]
        [--during-save [--url CKPT_URL] [--storage-options JSON] [--wait SECONDS]]

The server is the one ``--state`` describes (``tests.support.s3_server``
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
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chaos._ckpt import SaveWatcher, checkpoint_url_of_job, open_root, storage_options  # noqa: E402
from chaos._common import NothingToDo, base_parser, connect, run, seeded_rng, wait_until  # noqa: E402
from chaos._outage import add_outage_args, find_server, outage, require_job  # noqa: E402
from marind.log import get_logger  # noqa: E402

log = get_logger("chaos.storage_outage")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0], job_required=False)
    add_outage_args(parser, env_var="MARIND_S3_STATE")
    parser.add_argument("--endpoint", help="S3 endpoint, e.g. http://127.0.0.1:8333 (without --state)")
    parser.add_argument("--during-save", action="store_true",
                        help="start the outage while a checkpoint save is in progress")
    parser.add_argument("--url", help="checkpoint url to watch (default: the job spec's)")
    parser.add_argument("--storage-options", help="fsspec storage options as JSON "
                                                  "(default $MARIND_STORAGE_OPTIONS)")
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
        url = args.url or (checkpoint_url_of_job(client, args.job) if args.job else None)
        if not url:
            raise ValueError("--during-save needs the checkpoint url: pass --url or --job")
        fs, root = open_root(url, storage_options(url, args.storage_options, state.endpoint))
        watcher = SaveWatcher(fs, root)
        watcher.poll()
        log.info("waiting_for_save", url=url, timeout=args.wait)
        step = wait_until(watcher.poll, timeout=args.wait, interval=0.05)
        if step is None:
            raise NothingToDo(f"no checkpoint save started under {url} within {args.wait:g}s")
        extra = {"during_save_step": step}
    outage(state, args.seconds, ready_timeout=args.ready_timeout, job=args.job, seed=args.seed,
           **extra)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

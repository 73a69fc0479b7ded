"""`marind tensorboard JOB [--serve]`: where the agent writes the job's TensorBoard files (docs/design.md §5).

The agent of the node where global rank 0 runs writes what the program reports
(``marind.worker.report``: step, loss, tokens/s, its own metrics) as TensorBoard event files
into ``[job] tensorboard_dir`` (the reference trainer's ``train.tensorboard_dir`` is an older
name for it), by default ``{run dir}/tensorboard`` under that agent's state dir. This command
prints the directory; ``--serve`` starts TensorBoard on it (Ctrl-C stops it). A default
directory lives on the node that ran rank 0: run the command there, or set a shared
``tensorboard_dir``.
"""

from __future__ import annotations

import os
import subprocess
import sys


def register(sub) -> None:
    from marind.commands.jobs import common_flags

    p = sub.add_parser("tensorboard", help="a job's TensorBoard directory; --serve starts TensorBoard on it",
                       description="Print the directory the agent writes the job's TensorBoard files to "
                                   "(loss, tokens/s and the program's own metrics, by step); --serve starts "
                                   "TensorBoard on it.")
    p.add_argument("job")
    p.add_argument("--serve", action="store_true", help="start TensorBoard on the directory (Ctrl-C stops it)")
    p.add_argument("--host", default="127.0.0.1", help="TensorBoard's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=6006, help="TensorBoard's port (default 6006)")
    common_flags(p)
    p.set_defaults(handler=tensorboard)


def job_tensorboard_dir(args) -> str:
    """The job's TensorBoard directory as this machine sees it.

    Raises:
        NotFound: no such job, or its default directory is not on this machine.
        SpecError: the job's stored spec cannot be read.
    """
    from marind.control import job_records as J
    from marind.control.jobs_client import connect, local_log_files
    from marind.core.errors import NotFound, SpecError
    from marind.core.spec import tensorboard_dir

    view = J.read_job(connect(args.etcd, args.config, args.state_dir), args.job)
    if view.run_spec is None:
        raise SpecError(f"job {args.job}'s stored spec cannot be read ({view.spec_error}); resubmit it")
    logs = local_log_files(args.job, args.state_dir)          # the run dir this machine's agent kept
    if logs:
        return tensorboard_dir(view.run_spec, logs[0].parent.parent)
    path = tensorboard_dir(view.run_spec, None)
    if path:
        return path                                           # set in the spec: the same path everywhere
    raise NotFound(f"job {args.job}'s TensorBoard files ({{run dir}}/tensorboard) are not on this machine: run "
                   f"`marind tensorboard {args.job}` on the node that ran global rank 0 (see `marind status "
                   f"{args.job} --json`), or set [job] tensorboard_dir to a shared directory")


def tensorboard(args) -> int:
    from marind.core.errors import NotFound

    path = job_tensorboard_dir(args)
    if not args.serve:
        print(path)
        return 0
    if not os.path.isdir(path):
        raise NotFound(f"{path} does not exist yet: the agent makes it at the job's first report")
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", path, "--host", args.host, "--port", str(args.port)]
    sys.stderr.write(f"TensorBoard on {path}: http://{args.host}:{args.port}/ (Ctrl-C stops it)\n")
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0

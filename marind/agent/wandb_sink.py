"""A job's W&B run, fed from global rank 0's history file: ``python -m marind.agent.wandb_sink ...``.

Started by the agent (``marind.agent.run_history``) on the node where global rank 0 runs,
when the spec has ``[job] wandb = { project = "..." }``. It makes one W&B run (project, and
``entity``, ``name``, ``group``, ``mode`` when given; the name defaults to the job's id) in
``--dir``, follows the history file (``marind.core.history``) and logs each line's scalars
with the program's step as ``step`` (the run's x axis). SIGTERM (the run ended) reads what is
left and finishes the run; so does the agent going away (this process's parent changes).

``mode``: ``auto`` (default) is ``online`` when an API key is configured (``WANDB_API_KEY``, or
the netrc entry ``wandb login`` writes), else ``offline``: the run is kept in
``{dir}/wandb/offline-run-*`` and ``wandb sync`` uploads it later. Imports W&B; the agent does not.
"""

from __future__ import annotations

import argparse
import netrc
import os
import signal
import sys
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from marind.core.spec import WANDB_MODES


def has_api_key(environ: dict[str, str] | None = None) -> bool:
    """Is a W&B API key configured here (``WANDB_API_KEY``, or a netrc entry for W&B's host)?"""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = env.get("NETRC") or str(Path(env.get("HOME", "~")).expanduser() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str, environ: dict[str, str] | None = None) -> str:
    """``auto`` as ``online`` or ``offline`` (see the module docstring); others as given."""
    return mode if mode != "auto" else ("online" if has_api_key(environ) else "offline")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m marind.agent.wandb_sink")
    p.add_argument("--history", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--entity")
    p.add_argument("--name")
    p.add_argument("--group")
    p.add_argument("--mode", default="auto", choices=WANDB_MODES)
    p.add_argument("--poll", type=float, default=1.0)
    args = p.parse_args(argv)

    from marind.agent.run_history import scalars
    from marind.core.history import HistoryTail

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    import wandb

    mode: Literal["online", "offline"] = "online" if resolve_mode(args.mode) == "online" else "offline"
    run = wandb.init(project=args.project, entity=args.entity, name=args.name or args.job, group=args.group,
                     dir=args.dir, mode=mode, config={"marind_job": args.job},
                     settings=wandb.Settings(silent=True, x_disable_stats=True))
    run.define_metric("*", step_metric="step")
    print(f"wandb run {run.id} ({mode}) in {args.dir}; history {args.history}", flush=True)
    tail = HistoryTail(Path(args.history))
    parent = os.getppid()
    while True:
        ending = bool(stop) or os.getppid() != parent       # the run ended, or the agent is gone
        for line in tail.read():
            values = scalars(line)
            if values:
                run.log({"step": int(line["step"]), **values})
        if ending:
            break
        time.sleep(args.poll)
    run.finish()
    if mode == "offline":
        print(f"offline run kept in {args.dir}/wandb; upload it with: wandb sync {args.dir}/wandb/offline-run-*",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

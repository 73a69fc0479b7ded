"""`marind slurm-script RUN.toml`: the sbatch script that runs this job under Slurm (examples/slurm).

Writes the shipped script (``marind.integrations.slurm``) with the run's name, node range and
path filled in, to stdout or ``-o FILE`` (made executable). Bad input (an unreadable or invalid
run.toml, a bad ``--min-nodes``, an output path that cannot be written) is one line, exit 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("slurm-script", help="write the sbatch script that runs a run.toml under Slurm",
                       description="One marind agent per allocated node, the run submitted with the allocation's "
                                   "nodes and followed to its end; the script's exit code is the run's outcome. "
                                   "Submit it with `sbatch FILE`; settings: the comments at its top.")
    p.add_argument("spec", help="path to run.toml")
    p.add_argument("-o", "--output", help="write the script here (default: stdout)")
    p.add_argument("--min-nodes", type=int, help="the fewest nodes the run goes on with (default: job.nodes' minimum)")
    p.set_defaults(handler=slurm_script)


def slurm_script(args) -> int:
    from marind.integrations.slurm import render_sbatch

    text = render_sbatch(args.spec, args.min_nodes)
    if not args.output:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {out} is a directory; name the script file, e.g. {out / 'run.sbatch'}")
    try:
        out.write_text(text)
        os.chmod(out, 0o755)
    except OSError as exc:
        raise ValueError(f"cannot write {out}: {exc.strerror or exc}") from exc
    print(f"Wrote {out}; submit it with: sbatch {out}")
    return 0

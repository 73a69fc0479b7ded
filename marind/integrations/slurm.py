"""The sbatch script that runs a marind job under Slurm (``examples/slurm/``), written for one run.toml.

``marind/integrations/marind.sbatch`` is the script, shipped with the package so that
``marind slurm-script`` works from any install; ``examples/slurm/marind.sbatch`` is the same
file for users to copy (a test keeps the two identical). ``render_sbatch`` fills in what a
run.toml says and nothing else, so the body a user reads in the example is the body that runs:

* ``#SBATCH --job-name`` <- ``job.name``; ``#SBATCH --nodes`` <- ``job.nodes``' maximum (the
  allocation asked for);
* ``min_nodes_default`` <- ``job.nodes``' minimum (the fewest the run goes on with; the generic
  script's default is the allocation less one);
* ``run_toml_default`` <- the run.toml's absolute path (an argument to ``sbatch`` still wins).

The run.toml is checked as ``marind submit`` checks marind's own sections (one ``SpecError``
line, exit 2); paths on the cluster (working dir, data) are checked by the submit inside the job.
"""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path

from marind.core.errors import SpecError
from marind.core.spec import load_spec

SCRIPT_NAME = "marind.sbatch"
#: the lines ``render_sbatch`` rewrites, each of which the script holds exactly once
_FILLED = {
    "job_name": re.compile(r"^#SBATCH --job-name=.*$", re.M),
    "nodes": re.compile(r"^#SBATCH --nodes=.*$", re.M),
    "run_toml": re.compile(r"^run_toml_default=(?:\"[^\"\n]*\"|'[^'\n]*'|\S*)", re.M),
    "min_nodes": re.compile(r'^min_nodes_default="[^"\n]*"', re.M),
}


def script_text() -> str:
    """The generic script, as ``examples/slurm/marind.sbatch`` has it."""
    return resources.files("marind.integrations").joinpath(SCRIPT_NAME).read_text()


def render_sbatch(run_toml: str | Path, min_nodes: int | None = None) -> str:
    """The script for ``run_toml``: its name, its node range and its path filled in.

    Args:
        run_toml: the run spec (a path).
        min_nodes: the fewest nodes the run goes on with, in place of ``job.nodes``' minimum.

    Returns:
        The script's text.

    Raises:
        SpecError: the run.toml cannot be read or is invalid, or ``min_nodes`` is outside
            ``1..job.nodes' maximum`` (one line).
    """
    path = Path(run_toml)
    spec = load_spec(path)
    lo, hi = spec.job.nodes
    if min_nodes is not None:
        if not 1 <= min_nodes <= hi:
            raise SpecError(f"--min-nodes {min_nodes}: must be 1..{hi} (job.nodes' maximum in {path})")
        lo = min_nodes
    text = script_text()
    values = {
        "job_name": f"#SBATCH --job-name={spec.job.name}",
        "nodes": f"#SBATCH --nodes={hi}",
        "run_toml": f"run_toml_default={shlex.quote(str(path.resolve()))}",
        "min_nodes": f'min_nodes_default="{lo}"',
    }
    for key, pattern in _FILLED.items():
        text, count = pattern.subn(values[key].replace("\\", "\\\\"), text)     # a literal replacement
        if count != 1:
            raise RuntimeError(f"{SCRIPT_NAME} holds {count} lines for {key}, not one: the shipped script is broken")
    return text

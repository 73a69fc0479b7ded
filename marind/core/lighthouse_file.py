"""The torchft lighthouse file: where a node's agent tells its workers which lighthouse to follow.

``{run_dir}/ft/lighthouse.json`` (:func:`lighthouse_path`) holds ``{"address", "epoch",
"node"}``: the lighthouse's ``http://host:port``, its epoch (the ``mod_revision`` of the
elected ``{p}/jobs/{job}/ft/lighthouse`` key, which grows with every election) and the node
that runs it. The agent (``marind.agent.ft.coordinator``) rewrites it atomically whenever the
lighthouse changes; the trainer (``marind.trainer.ft.train``) reads it at start and whenever a
quorum fails, so that workers follow a moved lighthouse without a restart. A reader
treats a missing or malformed file as absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marind.core.jsonfile import read_json_object, write_json_atomic


def lighthouse_path(run_dir: str | Path) -> Path:
    """The lighthouse file of a run: ``{run_dir}/ft/lighthouse.json``."""
    return Path(run_dir) / "ft" / "lighthouse.json"


@dataclass(frozen=True)
class LighthouseRecord:
    """The lighthouse the workers of one node follow.

    Attributes:
        address: ``http://host:port`` of the torchft lighthouse.
        epoch: election epoch; a larger one means a newer lighthouse (0 when unknown).
        node: the node running it (informational; None when unknown).
    """

    address: str
    epoch: int = 0
    node: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object on disk: ``{"address", "epoch", "node"}``."""
        return {"address": self.address, "epoch": self.epoch, "node": self.node}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LighthouseRecord:
        """Parse the JSON object; ``address`` is required.

        Raises:
            KeyError: ``address`` is missing.
            ValueError, TypeError: ``epoch`` is not an integer.
        """
        node = d.get("node")
        return cls(address=str(d["address"]), epoch=int(d.get("epoch", 0)), node=None if node is None else str(node))


def write_lighthouse(run_dir: str | Path, record: LighthouseRecord) -> Path:
    """Atomically (re)write the run's lighthouse file, creating ``{run_dir}/ft``.

    Args:
        run_dir: the job's run directory on this node.
        record: what to publish.

    Returns:
        The file's path.

    Raises:
        OSError: the file could not be written.
    """
    path = lighthouse_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record.to_dict())
    return path


def read_lighthouse(run_dir: str | Path) -> LighthouseRecord | None:
    """The run's lighthouse record; None when the file is missing, half written or malformed."""
    d = read_json_object(lighthouse_path(run_dir))
    if d is None:
        return None
    try:
        return LighthouseRecord.from_dict(d)
    except (KeyError, ValueError, TypeError):
        return None

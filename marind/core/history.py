"""Every report of global rank 0, one JSON line each: what the agent turns into curves.

The progress record (``marind.core.progress``) holds a rank's last report only; the agent
reads it every tick and misses the steps between two looks. For the curves (TensorBoard,
W&B: ``marind.agent.run_history``) global rank 0's reporter also appends each report to
``$MARIND_RUN_DIR/progress/history-rank-0.jsonl`` (:func:`history_path`)::

    {"step": 12, "at": 1765000000.25, "pid": 4242, "loss": 2.31, "tokens_per_s": 5120.0,
     "metrics": {"lr": 0.0003}}

``loss``, ``tokens_per_s`` and ``metrics`` are left out when not reported. A loss that is
NaN or infinite is written as ``"loss_nonfinite": "nan"`` (or ``"inf"``, ``"-inf"``) and no
``loss``. Past :data:`ROTATE_BYTES` the writer renames the file to ``...jsonl.1`` (replacing
an older one) and starts a new one; :class:`HistoryTail` reads across that rename. A line that
finds the disk full is dropped (the curves have a gap there, training goes on); when a line
was cut short, the next one starts on a new line so that only the cut one is unreadable.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marind.core.disk import is_disk_full

#: The file's size at which the writer starts a new one (the old one becomes ``.1``).
ROTATE_BYTES = 32 << 20
#: Bytes one read of the tail takes at most (the rest waits for the next read).
MAX_READ = 8 << 20


def history_path(run_dir: str | Path) -> Path:
    """Global rank 0's report history: ``{run_dir}/progress/history-rank-0.jsonl``."""
    return Path(run_dir) / "progress" / "history-rank-0.jsonl"


def history_line(step: int, *, loss: float | None, tokens_per_s: float | None, metrics: dict[str, float] | None,
                 at: float, pid: int) -> dict[str, Any]:
    """One report as its history line (see the module docstring)."""
    line: dict[str, Any] = {"step": int(step), "at": round(at, 3), "pid": pid}
    if loss is not None:
        if math.isfinite(loss):
            line["loss"] = loss
        else:
            line["loss_nonfinite"] = "nan" if math.isnan(loss) else ("inf" if loss > 0 else "-inf")
    if tokens_per_s is not None:
        line["tokens_per_s"] = tokens_per_s
    if metrics:
        line["metrics"] = {k: v for k, v in metrics.items() if math.isfinite(v)}
    return line


class HistoryWriter:
    """Appends history lines to one file, rotating it past ``rotate_bytes``.

    Args:
        path: the file (its directory is made).
        rotate_bytes: the size past which the file is renamed to ``.1`` and started anew.
    """

    def __init__(self, path: Path, rotate_bytes: int = ROTATE_BYTES):
        self.path, self.rotate_bytes = path, rotate_bytes
        self.dropped = 0          # lines dropped on a full disk
        self._cut = False         # the last line written was cut short: the next starts a new line
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, line: dict[str, Any]) -> None:
        """Append one line (one ``write`` of a whole line: a reader never sees half of one).

        On a full disk (ENOSPC, EDQUOT) the line is dropped (``dropped`` counts them).

        Raises:
            OSError: the file could not be written for another reason.
        """
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        if self._cut:
            data = b"\n" + data
        try:
            if self.path.stat().st_size + len(data) > self.rotate_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except FileNotFoundError:
            pass
        written = 0
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                written = os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
        if written < len(data):
            self.dropped += 1
            self._cut = self._cut or written > 0
        else:
            self._cut = False


@dataclass
class HistoryTail:
    """Reads the lines a :class:`HistoryWriter` appended since the last read, across a rotation.

    Args:
        path: the history file.
    """

    path: Path
    _inode: int | None = None
    _offset: int = 0
    _partial: bytes = b""

    def read(self) -> list[dict[str, Any]]:
        """The whole lines appended since the last call (a malformed line is skipped)."""
        try:
            st = self.path.stat()
        except OSError:
            return []
        chunks = []
        if self._inode is not None and st.st_ino != self._inode:     # rotated: finish the old file first
            old = self.path.with_name(self.path.name + ".1")
            try:
                if old.stat().st_ino == self._inode:
                    chunks.append(self._read_from(old, self._offset))
            except OSError:
                pass
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        if st.st_size < self._offset:           # truncated: from the start
            self._offset, self._partial = 0, b""
        data = self._read_from(self.path, self._offset)
        self._offset += len(data)
        chunks.append(data)
        return self._lines(b"".join(chunks))

    @staticmethod
    def _read_from(path: Path, offset: int) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(MAX_READ)

    def _lines(self, data: bytes) -> list[dict[str, Any]]:
        parts = (self._partial + data).split(b"\n")
        self._partial = parts.pop()
        out = []
        for raw in parts:
            try:
                item = json.loads(raw)
            except ValueError:
                continue
            if isinstance(item, dict) and isinstance(item.get("step"), int):
                out.append(item)
        return out

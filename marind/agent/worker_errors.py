"""Why a job's workers failed, read from what torchrun and the workers leave on this node.

Two sources, both in the job's run dir:

* torchelastic's error file (``logs/error.json``, ``TORCHELASTIC_ERROR_FILE`` of the job's
  torchrun): written when torchrun gives up and the failed worker's entrypoint was wrapped in
  ``torch.distributed.elastic.multiprocessing.errors.record``; ``error_file_line`` reads it;
* ``logs/torchrun.log``, torchrun's and the workers' output: ``LogScan`` follows it and sees
  each failed round (torchrun's ``failed (exitcode: N) local_rank: R (pid: P)`` line, one per
  round that ended in a worker failure) and the last Python exception line printed before it
  (``FileNotFoundError: [Errno 2] No such file or directory: 'data/example.idx'``).

Counting those lines also gives the restarts torchrun made even when the workers die between
two of the agent's looks at the process table. Everything but ``LogTail`` is pure.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

#: The longest error line kept (etcd records, events, the status table cut it further).
MAX_LINE = 300
#: Bytes of log read per look at most; a burst beyond this is skipped (its failures are lost).
MAX_READ = 4 << 20

_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_PREFIX_RE = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_RANK_RE = re.compile(r"^\[rank(\d+)\]:")          # torch prefixes a rank's traceback once its group is up
#: The longest exception line kept for telling its cause (a CUDA OOM message runs past ``MAX_LINE``).
MAX_FULL = 4000
_EXC_RE = re.compile(r"^[A-Za-z_][\w.]*(?::\s.*)?$")      # `Type: message` or `Type`
#: Exceptions of torchrun itself, never a worker's reason.
_TORCHRUN_OWN = ("ChildFailedError", "SignalException")


def clean_line(line: str) -> str:
    """One log line without torchrun's ``[rankN]:``/``[defaultN]:`` prefix and trailing space."""
    return _PREFIX_RE.sub("", line.rstrip("\r\n")).rstrip()


def exception_line(line: str) -> str | None:
    """``line`` when it is the last line of a Python traceback (``Type: message``), else None.

    Args:
        line: one cleaned log line (``clean_line``), not indented.

    Returns:
        The line, cut to ``MAX_LINE``, or None.
    """
    if not line or line[0].isspace() or not _EXC_RE.match(line):
        return None
    name = line.split(":", 1)[0]
    if name.rsplit(".", 1)[-1] in _TORCHRUN_OWN:
        return None
    return line[:MAX_LINE]


def describe_exit(exitcode: int) -> str:
    """A worker's exit code in words: ``exit code 1``, ``killed by SIGKILL``."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def error_file_line(doc: object) -> str | None:
    """The error line of a torchelastic error file (the JSON ``record`` writes).

    Args:
        doc: the decoded file: ``{"message": {"message": "Type: text", "extraInfo": ...}}``,
            or ``{"message": "Type: text"}``.

    Returns:
        Its first non-empty line, cut to ``MAX_LINE``; None when there is none.
    """
    msg = doc.get("message") if isinstance(doc, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    if not isinstance(msg, str):
        return None
    for line in msg.splitlines():
        if line.strip():
            return line.strip()[:MAX_LINE]
    return None


@dataclass(frozen=True)
class Failure:
    """One round that ended in a worker failure on this node, as torchrun reported it.

    ``rank_errors`` holds, per global rank, the last exception line (up to ``MAX_FULL``) each rank
    printed in that round under torch's ``[rankN]:`` prefix; ``unranked`` the last one printed
    without it (before the rank's process group was up). The failed rank's own line is the cause;
    another rank's is at most its echo.
    """

    exitcode: int
    local_rank: int
    pid: int
    error: str | None        # the last exception line printed in that round, if any
    rank_errors: tuple[tuple[int, str], ...] = ()
    unranked: str | None = None
    group_rank: int | None = None   # this node's rank in the round (the rendezvous's ``rdzv_joined``), if logged

    @property
    def reason(self) -> str:
        """The error line, else the exit in words."""
        return self.error or f"worker local_rank {self.local_rank} {describe_exit(self.exitcode)}"


@dataclass
class LogScan:
    """Follows ``torchrun.log`` text as it grows: failed rounds and the last error line.

    Feed it the log's new text in order (``feed``); a line cut at the end of a chunk is kept
    for the next one.
    """

    failures: list[Failure] = field(default_factory=list)
    last_error: str | None = None        # the last exception line seen at all
    _round_error: str | None = None      # ... since the last failure line
    _in_traceback: bool = False
    _partial: str = ""
    _tb_rank: int | None = None
    _rank_errors: dict[int, str] = field(default_factory=dict)
    _unranked: str | None = None
    _group_rank: int | None = None

    def feed(self, text: str) -> list[Failure]:
        """Scan more of the log.

        Args:
            text: the text that follows what was fed before.

        Returns:
            The failures found in it.
        """
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        found = []
        for raw in lines:
            failure = self._line(raw)
            if failure is not None:
                found.append(failure)
        self.failures.extend(found)
        return found

    def _line(self, raw: str) -> Failure | None:
        m = _FAILED_RE.search(raw)
        if m:
            failure = Failure(int(m.group(1)), int(m.group(2)), int(m.group(3)), self._round_error,
                              tuple(sorted(self._rank_errors.items())), self._unranked, self._group_rank)
            self._round_error, self._in_traceback, self._unranked = None, False, None
            self._rank_errors = {}
            return failure
        if '"rdzv_joined"' in raw:
            self._group_rank = _joined_rank(raw)
            return None
        line = clean_line(raw)
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
            rank = _RANK_RE.match(raw)
            self._tb_rank = int(rank.group(1)) if rank else None
            return None
        if self._in_traceback and line and not line[0].isspace():
            self._in_traceback = False
            error = exception_line(line)
            if error is not None:
                self._round_error = self.last_error = error
                full = line[:MAX_FULL]
                if self._tb_rank is not None:
                    self._rank_errors[self._tb_rank] = full
                else:
                    self._unranked = full
        return None


def _joined_rank(raw: str) -> int | None:
    """The node's group rank from the rendezvous's ``rdzv_joined`` JSON log line, else None."""
    try:
        record = json.loads(raw[raw.index("{"):])
    except ValueError:
        return None
    rank = record.get("rank") if isinstance(record, dict) else None
    return rank if isinstance(rank, int) else None


@dataclass
class LogTail:
    """Reads a growing file from an offset, at most ``MAX_READ`` bytes per call.

    Args:
        path: the file.
        offset: where to start (the file's size when the run began).
    """

    path: Path
    offset: int = 0

    def read(self) -> str:
        """The text appended since the last call ('' when nothing new or the file is gone)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return ""
        if size < self.offset:            # truncated or replaced: start over
            self.offset = 0
        if size == self.offset:
            return ""
        start = max(self.offset, size - MAX_READ)
        with open(self.path, "rb") as fh:
            fh.seek(start)
            data = fh.read(size - start)
        self.offset = start + len(data)
        return data.decode(errors="replace")


def read_error_file(path: Path, newer_than: float) -> str | None:
    """The error line of torchelastic's error file at ``path`` if it was written after ``newer_than``.

    Args:
        path: the file (``{run_dir}/logs/error.json``).
        newer_than: the time the run began (an older file is a previous run's).

    Returns:
        The line, or None (no file, an old one, or one without a message).
    """
    try:
        if path.stat().st_mtime < newer_than:
            return None
        return error_file_line(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None

"""TensorBoard event files, written synchronously with TensorBoard's own record format and protos.

One :class:`EventWriter` per run and directory: a new file
``events.out.tfevents.{time}.{host}.{pid}.marind`` (``.1``, ``.2``, ... after it for another one in
the same second: the curves resumed after a full disk) opened with the ``brain.Event:2`` version
event, then one ``Event`` per scalar (``simple_value`` at the report's step and wall time).
No background thread, no TensorFlow: ``flush`` after each batch, ``close`` at the run's end.
A job that runs again (a new agent run) starts a new file in the same directory;
TensorBoard reads the files of a directory as one run.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter


class EventWriter:
    """Scalars into a new TensorBoard event file under ``directory``.

    Args:
        directory: the log directory (made if missing).

    Raises:
        OSError: the directory or the file could not be made.
    """

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.marind"
        self.path, n = directory / name, 0
        while self.path.exists():           # a second file this second (the curves resumed): sorts after
            n += 1
            self.path = directory / f"{name}.{n}"
        self._fh = open(self.path, "ab")
        self._records = RecordWriter(self._fh)
        try:
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
            self.flush()
        except OSError:                     # a full disk: leave no empty file behind
            try:
                self._fh.close()
            except OSError:
                pass
            self.path.unlink(missing_ok=True)
            raise

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        """One scalar ``tag`` = ``value`` at ``step`` (``wall_time``: when it was reported)."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._write(Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        """Write what is buffered to the file."""
        self._records.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._records.close()

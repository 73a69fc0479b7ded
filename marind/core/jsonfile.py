"""Small JSON files that one process rewrites and others poll: atomic write, tolerant read.

A writer never leaves a half-written file behind, and a full disk does not stop it. Each file
has a spare beside it, ``.{name}.spare``, made when the file is first written (while there is
room): a rewrite puts the new record into the spare's blocks (overwritten in place, padded with
spaces to the spare's size, so no block is allocated) and swaps the two names in one atomic
rename (``renameat2(RENAME_EXCHANGE)``); the old record becomes the next spare. So a reader sees
the old record or the new one, and a file rewritten every step (a rank's progress record, the
run's ``lease.json``) goes on being rewritten on a filesystem that is full (ENOSPC), as long as
the record fits in the spare's size (4 KiB and up). Where the spare is missing or too small, the
record goes to ``.{name}.{pid}.tmp`` renamed over the target (``os.replace``), which needs free
space; where the filesystem cannot swap two names (NFS), the filled spare is renamed over the
target and a new spare made at the next rewrite. One process writes a given file.

A reader treats a missing, unreadable or malformed file as absent; trailing spaces are JSON
whitespace.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from pathlib import Path
from typing import Any

#: a record is padded to a multiple of this (one page, one block of most filesystems)
PAD_BYTES = 4096

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc: Any = None


def _padded(data: bytes, size: int) -> bytes:
    """``data`` followed by spaces up to ``size`` or the next multiple of ``PAD_BYTES``, whichever is larger."""
    want = max(size, -(-(len(data) + 1) // PAD_BYTES) * PAD_BYTES)
    return data + b" " * (want - len(data))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where this system or filesystem cannot
    (or ``b`` does not exist)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    if _libc(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOENT, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _write_into_spare(spare: Path, path: Path, data: bytes) -> bool:
    """The rewrite without allocating; False when it cannot be done that way (no spare, or too small)."""
    try:
        fd = os.open(spare, os.O_WRONLY)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        body = _padded(data, size)
        if len(body) > size:
            return False                      # the record outgrew the spare: allocate anew
        view = memoryview(body)
        while view:
            view = view[os.pwrite(fd, view, len(body) - len(view)):]
    finally:
        os.close(fd)
    if not _exchange(spare, path):
        os.replace(spare, path)               # no swap here (or no target yet): the spare is used up
    return True


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON, atomically for its readers.

    Args:
        path: the file to (re)write; its directory must exist.
        obj: anything ``json.dumps`` accepts.

    Raises:
        OSError: the file could not be written or renamed (``marind.core.disk.is_disk_full``
            tells a full disk: then the spare was missing or too small).
        TypeError: ``obj`` is not JSON serialisable.
    """
    data = json.dumps(obj).encode()
    spare = path.with_name(f".{path.name}.spare")
    if _write_into_spare(spare, path, data):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(_padded(data, 0))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    try:                                      # the spare for the next rewrites, while there is room
        if not spare.exists():
            tmp.write_bytes(_padded(data, 0))
            os.replace(tmp, spare)
    except OSError:
        tmp.unlink(missing_ok=True)           # no room even for that: the next rewrite tries again


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object.

    Args:
        path: the file to read.

    Returns:
        The decoded object, or None.
    """
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None

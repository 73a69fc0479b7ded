"""Small JSON files that one process rewrites and others poll: atomic write, tolerant read.

A writer never leaves a half-written file behind: it writes ``.{name}.{pid}.tmp`` in the
same directory and renames it over the target (``os.replace``), so a reader sees the old
record or the new one. A reader treats a missing, unreadable or malformed file as absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON in one rename.

    Args:
        path: the file to (re)write; its directory must exist.
        obj: anything ``json.dumps`` accepts.

    Raises:
        OSError: the temporary file could not be written or renamed.
        TypeError: ``obj`` is not JSON serialisable.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


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

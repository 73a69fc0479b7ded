"""The commit fence: rank 0 writes a manifest only while its world may still commit.

``CheckpointStore(fence_file=...)`` names a local JSON file ``{"valid_until": unix_seconds,
"window"?: seconds, "ttl"?: seconds}``; marind's agent keeps one per run (its node lease's
last renewal + the window after which its peers may replace its world). Past
``valid_until`` other nodes may have formed a new world without this one, so a save of the
old world must not commit. A file whose time is short is re-read until a renewal moves it
(at most ``window`` seconds, or ``ttl``): a renewal that is merely due does not cost a
checkpoint. A missing or malformed file does not fence.
"""

from __future__ import annotations

import json
import time

from ckpt_store.errors import CheckpointSaveFailed

#: how often a short fence file is re-read while waiting for a renewal
POLL_S = 0.1


def _read(path: str) -> tuple[float, float | None, float | None, dict] | None:
    """(valid_until, window, ttl, the whole document) of the file (None where it gives none), or
    None when it is missing or malformed."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
        window, ttl = doc.get("window"), doc.get("ttl")
        return (float(doc["valid_until"]), float(window) if window else None, float(ttl) if ttl else None,
                doc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_fence(fence: tuple[str, float] | None, now: float | None = None, wait: bool = True) -> dict | None:
    """Rank 0, right before the manifest: may this world still commit?

    Args:
        fence: ``(path, margin_s)`` or None (no fence). The file's ``valid_until`` must leave
            ``margin_s`` (at most half the file's ``window``, else a quarter of its ``ttl``).
        now: the current Unix time (tests: no waiting); ``time.time()`` when None.
        wait: when the time left is short, re-read the file for up to its ``window`` (else
            ``ttl``) seconds for a renewal before failing (only when ``now`` is None).

    Returns:
        What the commit was allowed on, for the manifest's ``fence`` record (a history checker
        reads it: a commit's ``checked_at`` must lie inside its world's ``valid_until``): the
        file's ``valid_until``, ``renewed_at`` and ``node`` where it has them, ``checked_at`` and
        ``margin_s``; None without a fence (no fence given, or no readable file).

    Raises:
        CheckpointSaveFailed: the fence has passed (the save aborts uncommitted).
    """
    if not fence:
        return None
    path, margin = fence
    read = _read(path)
    if read is None:
        return None                 # no fence file: nothing to fence against
    valid_until, window, ttl, doc = read
    margin = min(margin, window / 2) if window else min(margin, ttl / 4) if ttl else margin
    if now is None and wait:
        deadline = time.time() + (window or ttl or 0.0)
        while valid_until - time.time() < margin and time.time() < deadline:
            time.sleep(POLL_S)
            read = _read(path)
            if read is None:
                return None
            valid_until, doc = read[0], read[3]
    t = time.time() if now is None else now
    if valid_until - t < margin:
        raise CheckpointSaveFailed(
            f"not committing: this world may have been replaced ({path}: valid until {valid_until:.1f}, "
            f"now {t:.1f}, margin {margin:g}s)")
    record = {"valid_until": valid_until, "checked_at": t, "margin_s": margin}
    record.update({k: doc[k] for k in ("renewed_at", "node") if k in doc})
    return record

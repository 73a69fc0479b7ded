"""The commit fence: rank 0 writes a manifest only while its world may still commit.

``CheckpointStore(fence_file=...)`` names a local JSON file ``{"valid_until": unix_seconds,
"ttl"?: seconds}``; marind's agent keeps one per run (its node lease: last renewal + TTL).
Past ``valid_until`` other nodes may have formed a new world without this one, so a save
of the old world must not commit. A missing or malformed file does not fence.
"""

from __future__ import annotations

import json
import time

from ckpt_store.errors import CheckpointSaveFailed


def check_fence(fence: tuple[str, float] | None, now: float | None = None) -> None:
    """Rank 0, right before the manifest: may this world still commit?

    Args:
        fence: ``(path, margin_s)`` or None (no fence). The file's ``valid_until`` must leave
            ``margin_s`` (at most a quarter of the file's ``ttl`` when it gives one).
        now: the current Unix time (tests); ``time.time()`` when None.

    Raises:
        CheckpointSaveFailed: the fence has passed (the save aborts uncommitted).
    """
    if not fence:
        return
    path, margin = fence
    try:
        with open(path) as fh:
            doc = json.load(fh)
        valid_until = float(doc["valid_until"])
        if doc.get("ttl"):
            margin = min(margin, float(doc["ttl"]) / 4)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return                      # no fence file: nothing to fence against
    now = time.time() if now is None else now
    if valid_until - now < margin:
        raise CheckpointSaveFailed(
            f"not committing: this world may have been replaced ({path}: valid until {valid_until:.1f}, "
            f"now {now:.1f}, margin {margin:g}s)")

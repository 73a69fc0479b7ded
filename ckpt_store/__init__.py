"""Sharded, async, atomically committed Zarr v3 checkpoints on S3 or disk (DESIGN §4)."""

from ckpt_store.errors import (CheckpointCorrupt, CheckpointError, CheckpointMismatch,
                               CheckpointNotFound, CheckpointSaveFailed)
from ckpt_store.store import CheckpointStore, PendingSave, VerifyReport

__all__ = ["CheckpointStore", "PendingSave", "VerifyReport", "CheckpointError",
           "CheckpointNotFound", "CheckpointCorrupt", "CheckpointMismatch", "CheckpointSaveFailed"]

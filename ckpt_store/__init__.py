"""Sharded, async, atomically committed Zarr v3 checkpoints on S3 or disk (docs/design.md §4).

The store classes load on first use, so the writer process (``python -m
ckpt_store.writer_process``) runs without importing torch.
"""

from ckpt_store.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointFormatUnsupported,
    CheckpointMismatch,
    CheckpointNotFound,
    CheckpointSaveFailed,
    CheckpointStorageUnavailable,
)

__all__ = ["CheckpointStore", "PendingSave", "VerifyReport", "CheckpointError",
           "CheckpointNotFound", "CheckpointCorrupt", "CheckpointMismatch", "CheckpointSaveFailed",
           "CheckpointFormatUnsupported", "CheckpointStorageUnavailable"]


def __getattr__(name: str):
    if name in ("CheckpointStore", "PendingSave", "VerifyReport"):
        from ckpt_store import store

        return getattr(store, name)
    raise AttributeError(f"module 'ckpt_store' has no attribute {name!r}")

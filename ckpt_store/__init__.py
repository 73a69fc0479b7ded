"""Sharded, async, atomically committed Zarr v3 checkpoints on S3 or disk (docs/design.md §4).

Public surface (code outside ``ckpt_store`` imports nothing else; ``tools/import_graph.py
--check`` enforces it): this package (``CheckpointStore``, ``PendingSave``, ``VerifyReport``,
the errors, and ``all_ranks_ok`` / ``all_gather_json``, the collectives a caller that agrees with
the store's ranks uses), ``ckpt_store.errors`` and ``ckpt_store.export``. Everything else is
internal, grouped by stage:

* ``store``: ``CheckpointStore``, the API; ``agreement``: how the ranks of a save or load agree
  (the store's few collectives); ``errors``; ``log``: its structlog loggers;
* ``storage/``: the storage protocol and its two backends (local disk, fsspec object stores),
  and the local disk's I/O modes (direct or page-cache reads and writes, durable flushes);
* ``format/``: the bytes at rest: Zarr v3 metadata and chunk codecs, the manifest, step
  directories and retention, the layout math and the save/load plan;
* ``save/``: a save's stages: gather, snapshot, hand-off to a writer (thread or process), each
  rank's part, the fence and the commit;
* ``load/``: a load into any layout, the newest step that loads clean, ``verify``;
* ``export/``: safetensors files for tools that do not read Zarr (public);
* ``memory/``: the memory tier: checkpoints in the hosts' memory, each part replicated on the
  next node of a ring (``MemoryTier``, and the ring's pure placement math, public here).

The store classes load on first use, so the writer process (``python -m
ckpt_store.save.writer_process``) runs without importing torch.
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
           "CheckpointFormatUnsupported", "CheckpointStorageUnavailable", "all_ranks_ok", "all_gather_json",
           "MemoryTier", "MemoryStep", "survives", "memory_needed", "memory_fits"]

_LAZY = {"CheckpointStore": "store", "PendingSave": "store", "VerifyReport": "store",
         "all_ranks_ok": "agreement", "all_gather_json": "agreement",
         "MemoryTier": "memory.tier", "MemoryStep": "memory.tier", "survives": "memory.ring",
         "memory_needed": "memory.ring", "memory_fits": "memory.ring"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"ckpt_store.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ckpt_store' has no attribute {name!r}")

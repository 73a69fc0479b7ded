"""``verify``: re-read every object of a committed step and check its size and checksums.

Unlike a load, which reads only the pieces a rank needs, this reads each object whole:
its size against the manifest, its crc32c, and for a chunk object the digest of its
pieces' checksums (``chunks_crc32c``), so an object of another save is caught too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import crc32c

from ckpt_store.errors import CheckpointCorrupt, CheckpointError
from ckpt_store.format import layout
from ckpt_store.format.manifest import read_manifest
from ckpt_store.format.zarr_format import ArraySpec, chunk_key, chunks_digest, embedded_crcs

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage


@dataclass
class VerifyReport:
    """What ``CheckpointStore.verify`` found: ``ok`` when ``problems`` is empty; the objects
    and bytes it read."""

    step: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    objects: int = 0
    bytes: int = 0


def verify_step(st: Storage, d: str) -> tuple[list[str], int, int]:
    """Re-read every object of a committed step; (problems, objects, bytes)."""
    try:
        manifest = read_manifest(st, d)
    except CheckpointError as exc:
        return [str(exc)], 0, 0
    problems: list[str] = []
    specs: dict[str, ArraySpec] = {}    # chunk object key -> its array
    for name, meta in manifest["arrays"].items():
        spec = ArraySpec.from_json(name, meta)
        if any(n == 0 for n in spec.shape):
            continue
        for cell in layout.all_cells(spec.shape, spec.chunks):
            specs[chunk_key(name, cell)] = spec
            if chunk_key(name, cell) not in manifest["objects"]:
                problems.append(f"{d}/{chunk_key(name, cell)}: chunk missing from the manifest")
    keys = sorted(manifest["objects"])

    def one(key):
        obj = manifest["objects"][key]
        try:
            raw = st.read(f"{d}/{key}")
        except FileNotFoundError:
            return f"{d}/{key}: object missing", 0
        except Exception as exc:  # noqa: BLE001 - a report, not a crash
            return f"{d}/{key}: unreadable ({exc})", 0
        if len(raw) != int(obj["size"]):
            return f"{d}/{key}: size {len(raw)} != {obj['size']} (truncated or overwritten)", len(raw)
        if crc32c.crc32c(raw) != int(obj["crc32c"]):
            return f"{d}/{key}: crc32c mismatch (corrupt)", len(raw)
        if key in specs and "chunks_crc32c" in obj:
            try:
                digest = chunks_digest(embedded_crcs(f"{d}/{key}", raw, specs[key]))
            except CheckpointCorrupt as exc:
                return str(exc), len(raw)
            if digest != obj["chunks_crc32c"]:
                return f"{d}/{key}: other data than the manifest lists (an object of another save)", len(raw)
        return None, len(raw)

    total = 0
    for problem, n in st.pool().map(one, keys):
        total += n
        if problem:
            problems.append(problem)
    return problems, len(keys), total

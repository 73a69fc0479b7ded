"""A step's ``manifest.json``: the commit record, read and checked in one place.

A step exists for readers once its manifest does (docs/design.md §4). ``read_manifest``
refuses one of a newer format and names what is malformed, so that every reader (load,
verify, ``ckpt ls``/``inspect``) trusts the fields it uses.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, TypeGuard

from ckpt_store.errors import CheckpointCorrupt, CheckpointFormatUnsupported, CheckpointNotFound
from ckpt_store.zarr_format import ITEMSIZE

if TYPE_CHECKING:
    from ckpt_store.storage import Storage

MANIFEST = "manifest.json"
#: the checkpoint format this marind writes (``manifest.json``'s "format") and the only one it reads
FORMAT = 1


def read_manifest(st: Storage, d: str) -> dict:
    """The manifest of step dir ``d``, checked: CheckpointNotFound when there is none,
    CheckpointFormatUnsupported for another format, CheckpointCorrupt when it is malformed."""
    key = f"{d}/{MANIFEST}"
    try:
        raw = st.read(key)
    except FileNotFoundError:
        raise CheckpointNotFound(f"no committed checkpoint at {st.url}/{d}") from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise CheckpointCorrupt(key, f"unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(key, f"malformed manifest (a JSON {type(manifest).__name__}, not an object)")
    fmt = manifest.get("format")
    if _is_int(fmt) and fmt > FORMAT:
        raise CheckpointFormatUnsupported(
            f"checkpoint {d} under {st.url} has format {fmt}, newer than this marind reads "
            f"({FORMAT}): upgrade marind")
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointCorrupt(key, f"malformed manifest ({problem})")
    return manifest


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v, least: int) -> bool:
    return isinstance(v, list) and all(_is_int(i) and i >= least for i in v)


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with a parsed manifest (None: every field a reader uses is there and typed)."""
    if not _is_int(m.get("format")) or m["format"] != FORMAT:
        return f"format {m.get('format')!r} is not a known checkpoint format (this marind reads {FORMAT})"
    if not _is_int(m.get("step")):
        return "no integer 'step'"
    if not isinstance(m.get("world", {}), dict):
        return "'world' is not an object"
    if not isinstance(m.get("arrays"), dict) or not isinstance(m.get("objects"), dict):
        return "'arrays' or 'objects' missing or not an object"
    for name, obj in m["objects"].items():
        if not isinstance(obj, dict) or not _is_int(obj.get("size")) or obj["size"] < 0 \
                or not _is_int(obj.get("crc32c")):
            return f"object entry {name!r} lacks an integer 'size' or 'crc32c'"
        if not _is_int(obj.get("chunks_crc32c", 0)):
            return f"object entry {name!r} has a non-integer 'chunks_crc32c'"
    for name, a in m["arrays"].items():
        if not isinstance(a, dict):
            return f"array entry {name!r} is not an object"
        if not _ints(a.get("shape"), 0) or not _ints(a.get("chunks"), 1) or len(a["shape"]) != len(a["chunks"]):
            return f"array {name!r} lacks a valid 'shape' and 'chunks'"
        if a.get("dtype") not in ITEMSIZE:
            return f"array {name!r} has unknown dtype {a.get('dtype')!r}"
        rows = a.get("inner_rows")
        if rows is not None and not (_is_int(rows) and rows > 0 and a["chunks"]):
            return f"array {name!r} has invalid 'inner_rows' {rows!r}"
    return None

"""A step's ``manifest.json``: the commit record, read and checked in one place.

A step exists for readers once its manifest does (docs/design.md §4). ``read_manifest``
refuses one of a newer format and names what is malformed, so that every reader (load,
verify, ``ckpt ls``/``inspect``) trusts the fields it uses.

Format 2 keeps the per-object list out of the manifest: each rank writes its own
(``parts/rank-R.json``) and the manifest names those files with their sizes and crc32c,
so that nothing rank 0 reads or writes at the commit grows with arrays x ranks.
``read_manifest`` reads and checks the parts and returns the manifest with every object
under ``objects`` (the parts files included), as a format-1 manifest has them. In a load
of W ranks (``PartShare``) each rank reads 1/W of the lists and the ranks all-gather them:
W reads of lists for the job instead of W x W.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import crc32c

from ckpt_store.errors import CheckpointCorrupt, CheckpointError, CheckpointFormatUnsupported, CheckpointNotFound
from ckpt_store.format.zarr_format import ITEMSIZE

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage

MANIFEST = "manifest.json"
#: the checkpoint format this marind writes (``manifest.json``'s "format")
FORMAT = 2
#: the formats it reads (1: every object listed in the manifest itself)
READS = (1, 2)


def part_key(rank: int) -> str:
    """Rank ``rank``'s object list, relative to the step dir (format 2)."""
    return f"parts/rank-{rank:05d}.json"


@dataclass(frozen=True)
class PartShare:
    """How the ranks of a load share the reading of a step's object lists: rank ``rank`` of
    ``world`` reads lists ``rank``, ``rank + world``, ... and ``all_gather`` (every rank's
    JSON value, in rank order: ``agreement.all_gather_json``) hands them to every rank."""

    rank: int
    world: int
    all_gather: Callable[[Any], list]


def read_manifest(st: Storage, d: str, share: PartShare | None = None) -> dict:
    """The manifest of step dir ``d``, checked: CheckpointNotFound when there is none,
    CheckpointFormatUnsupported for another format, CheckpointCorrupt when it is malformed.

    Args:
        st: the storage.
        d: the step dir.
        share: every rank of a load reads the same step together: each reads 1/W of the W
            object lists and they exchange them (W reads of lists in all, not W x W). Every
            rank must call it; a failure on any rank raises on every rank (the failing rank
            its own error, the others one that names it and is of the same kind).
    """
    if share is not None and share.world > 1:
        return _read_shared(st, d, share)
    manifest = _read_head(st, d)
    if manifest["format"] >= 2:
        manifest["objects"] = {**manifest["objects"], **_read_parts(st, d, manifest["parts"])}
    return manifest


def _read_head(st: Storage, d: str) -> dict:
    """``manifest.json`` itself, checked (its object lists not read)."""
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


def _read_shared(st: Storage, d: str, share: PartShare) -> dict:
    """``read_manifest`` with the object lists read 1/W per rank and all-gathered. The
    exchange happens whatever this rank found, so that no rank is left waiting in it."""
    manifest: dict | None = None
    error: BaseException | None = None
    try:
        manifest = _read_head(st, d)
        parts = manifest["parts"][share.rank::share.world] if manifest["format"] >= 2 else []
        mine: dict = {"objects": _read_parts(st, d, parts)}
    except Exception as exc:  # noqa: BLE001 - raised below, after the exchange
        error = exc
        mine = {"error": _error_json(exc)}
    got = share.all_gather(mine)
    if error is not None:
        raise error
    assert manifest is not None
    for r, theirs in enumerate(got):
        if "error" in theirs:
            raise _error_from_json(theirs["error"], r)
    merged = dict(manifest["objects"])
    for theirs in got:
        merged.update(theirs["objects"])
    manifest["objects"] = merged
    return manifest


def _error_json(exc: BaseException) -> dict:
    if isinstance(exc, CheckpointCorrupt):
        return {"kind": "corrupt", "object": exc.object, "reason": exc.reason}
    kinds: dict[type, str] = {CheckpointNotFound: "not_found", CheckpointFormatUnsupported: "format"}
    kind = kinds.get(type(exc), "other")
    return {"kind": kind, "message": f"{type(exc).__name__}: {exc}" if kind == "other" else str(exc)}


def _error_from_json(err: dict, rank: int) -> CheckpointError:
    """Another rank's failure to read the manifest or its share of the lists, of the same kind
    (a corrupt list is corrupt on every rank: the step is skipped and quarantined alike)."""
    kind = err.get("kind")
    if kind == "corrupt":
        return CheckpointCorrupt(str(err.get("object")), str(err.get("reason")))
    if kind == "not_found":
        return CheckpointNotFound(str(err.get("message")))
    if kind == "format":
        return CheckpointFormatUnsupported(str(err.get("message")))
    return CheckpointError(f"rank {rank} failed to read the manifest: {err.get('message')}")


def _read_parts(st: Storage, d: str, parts: list[dict]) -> dict:
    """Every object the ranks' lists name, plus the lists themselves; each list checked
    against the manifest's size and crc32c (``CheckpointCorrupt`` naming it)."""
    def one(part: dict) -> dict:
        key = f"{d}/{part['key']}"
        try:
            raw = st.read(key)
        except FileNotFoundError:
            raise CheckpointCorrupt(key, "missing (an object list the manifest names)") from None
        if len(raw) != part["size"] or crc32c.crc32c(raw) != part["crc32c"]:
            raise CheckpointCorrupt(key, f"{len(raw)} bytes with crc32c {crc32c.crc32c(raw)}, the manifest "
                                         f"says {part['size']} and {part['crc32c']}")
        try:
            objects = json.loads(raw)["objects"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(key, f"unreadable object list ({exc})") from exc
        problem = _objects_problem(objects)
        if problem:
            raise CheckpointCorrupt(key, f"malformed object list ({problem})")
        return {**objects, part["key"]: {"size": part["size"], "crc32c": part["crc32c"]}}

    merged: dict = {}
    for objects in st.pool().map(one, parts):
        merged.update(objects)
    return merged


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v, least: int) -> bool:
    return isinstance(v, list) and all(_is_int(i) and i >= least for i in v)


def _objects_problem(objects) -> str | None:
    """What is wrong with an ``objects`` map (None: every entry has an integer size and crc32c)."""
    if not isinstance(objects, dict):
        return "'objects' is not an object"
    for name, obj in objects.items():
        if not isinstance(obj, dict) or not _is_int(obj.get("size")) or obj["size"] < 0 \
                or not _is_int(obj.get("crc32c")):
            return f"object entry {name!r} lacks an integer 'size' or 'crc32c'"
        if not _is_int(obj.get("chunks_crc32c", 0)):
            return f"object entry {name!r} has a non-integer 'chunks_crc32c'"
    return None


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with a parsed manifest (None: every field a reader uses is there and typed)."""
    if not _is_int(m.get("format")) or m["format"] not in READS:
        return f"format {m.get('format')!r} is not a known checkpoint format (this marind reads {READS})"
    if not _is_int(m.get("step")):
        return "no integer 'step'"
    if not isinstance(m.get("world", {}), dict):
        return "'world' is not an object"
    if not isinstance(m.get("arrays"), dict) or not isinstance(m.get("objects"), dict):
        return "'arrays' or 'objects' missing or not an object"
    problem = _objects_problem(m["objects"])
    if problem:
        return problem
    if m["format"] >= 2:
        parts = m.get("parts")
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("key"), str) and p["key"].startswith("parts/")
                and _is_int(p.get("size")) and _is_int(p.get("crc32c")) for p in parts):
            return "'parts' missing or an entry lacks a 'parts/...' 'key', an integer 'size' or 'crc32c'"
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

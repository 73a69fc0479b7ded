"""The read side: manifest, load into this rank's layout, verify.

``load_step`` reads only the chunks (and, inside sharded chunks, only the
inner chunks) that intersect this rank's box of each target tensor; every
piece read is checked against its crc32c. All mismatched or missing keys
are reported at once, before anything is read.
"""

from __future__ import annotations

import json

import crc32c
import torch
from torch.distributed.tensor import DTensor

from ckpt_store import layout
from ckpt_store.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound
from ckpt_store.layout import Box
from ckpt_store.plan import flatten, local_pieces
from ckpt_store.zarr_format import (EMPTY, TORCH_DTYPES, ArraySpec, chunk_key, decode_block,
                                    decode_index, dtype_name, index_nbytes)

MANIFEST = "manifest.json"


def read_manifest(st, d: str) -> dict:
    key = f"{d}/{MANIFEST}"
    try:
        raw = st.read(key)
    except FileNotFoundError:
        raise CheckpointNotFound(f"no committed checkpoint at {st.url}/{d}") from None
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest.get("arrays"), dict) or not isinstance(manifest.get("objects"), dict):
            raise ValueError("arrays/objects missing")
    except (ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(key, f"unreadable manifest ({exc})") from exc
    return manifest


def _check(name: str, t: torch.Tensor, arrays: dict) -> str | None:
    meta = arrays.get(name)
    if meta is None:
        return f"{name}: missing from the checkpoint"
    problems = []
    if list(t.shape) != list(meta["shape"]):
        problems.append(f"shape {list(t.shape)} != saved {meta['shape']}")
    try:
        dt = dtype_name(t.dtype)
    except ValueError:
        dt = str(t.dtype)
    if dt != meta["dtype"]:
        problems.append(f"dtype {dt} != saved {meta['dtype']}")
    return f"{name}: {', '.join(problems)}" if problems else None


def _obj(manifest: dict, d: str, key: str) -> dict:
    obj = manifest["objects"].get(key)
    if obj is None:
        raise CheckpointCorrupt(f"{d}/{key}", "listed by no manifest entry (missing object)")
    return obj


def load_step(st, d: str, state: dict, rank: int, values: bool = True) -> dict:
    """Fill ``state`` in place from step dir ``d``; returns read statistics."""
    manifest = read_manifest(st, d)
    step = manifest.get("step", -1)
    tensors, _ = flatten(state)
    problems = [p for p in (_check(n, t, manifest["arrays"]) for n, t in sorted(tensors.items())) if p]
    if problems:
        raise CheckpointMismatch(step, problems)
    stats = {"bytes_read": 0, "bytes_needed": 0, "objects": 0}
    jobs = []   # (spec, box, host, cell, cbox, inter)
    hosts = []  # (local tensor, host tensor) to copy back when host is a staging buffer
    for name, t in sorted(tensors.items()):
        spec = ArraySpec.from_json(name, manifest["arrays"][name])
        pieces, local = local_pieces(t, rank)
        pieces = [p for p in pieces if not p.box.empty]
        if not pieces:
            continue
        if local.device.type == "cpu" and local.is_contiguous():
            host = local
        else:
            host = torch.empty(tuple(local.shape), dtype=local.dtype)
            hosts.append((local, host))
        for piece in pieces:
            box = piece.box
            view = host[piece.local_slices()]
            stats["bytes_needed"] += box.numel * spec.itemsize
            for cell in layout.cells_for_box(box, spec.chunks):
                cbox = layout.cell_box(cell, spec.chunks, spec.shape)
                jobs.append((spec, box, view, cell, cbox, box.intersect(cbox)))
    # phase 1: shard indexes of partially needed sharded chunks
    partial = [j for j in jobs if j[0].inner_rows and j[5] != j[4]]
    index_reqs = []
    for spec, _, _, cell, _, _ in partial:
        key = chunk_key(spec.name, cell)
        size = int(_obj(manifest, d, key)["size"])
        index_reqs.append((f"{d}/{key}", size - index_nbytes(spec), size))
    indexes = {}
    for (spec, _, _, cell, _, _), req, raw in zip(partial, index_reqs, _read(st, index_reqs)):
        stats["bytes_read"] += len(raw)
        indexes[(spec.name, cell)] = decode_index(req[0], raw, spec)
    # phase 2: data
    reqs, plans = [], []
    for job in jobs:
        spec, box, host, cell, cbox, inter = job
        key = chunk_key(spec.name, cell)
        obj = _obj(manifest, d, key)
        if (spec.name, cell) not in indexes:
            reqs.append((f"{d}/{key}", 0, int(obj["size"])))
            plans.append((job, "whole", int(obj["crc32c"])))
            continue
        index = indexes[(spec.name, cell)]
        rows = spec.inner_rows
        lo = inter.offset[0] - cbox.offset[0]
        hi = lo + inter.shape[0]
        ks = list(range(lo // rows, -(-hi // rows)))
        spans = [(int(index[k][0]), int(index[k][1])) for k in ks]
        if any(o == EMPTY for o, _ in spans):
            raise CheckpointCorrupt(f"{d}/{key}", "an inner chunk the layout needs is absent")
        start, end = spans[0][0], spans[-1][0] + spans[-1][1]
        contiguous = all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        if not contiguous:
            start, end = min(o for o, _ in spans), max(o + n for o, n in spans)
        reqs.append((f"{d}/{key}", start, end))
        plans.append((job, [(k, o - start, n) for k, (o, n) in zip(ks, spans)], None))
    for req, raw, (job, how, crc) in zip(reqs, _read(st, reqs), plans):
        stats["bytes_read"] += len(raw)
        stats["objects"] += 1
        _place(req[0], raw, job, how, crc)
    for local, host in hosts:
        local.copy_(host)
    if values:
        _apply_values(st, d, manifest, state, rank)
    return stats


def _read(st, reqs):
    try:
        return st.read_ranges(reqs)
    except FileNotFoundError as exc:
        raise CheckpointCorrupt(str(exc.filename or exc), "object missing") from exc


def _copy(host: torch.Tensor, box: Box, block: torch.Tensor, block_box: Box) -> None:
    inter = box.intersect(block_box)
    if inter is not None:
        host[inter.slices(box.offset)] = block[inter.slices(block_box.offset)]


def _place(key: str, raw: bytes, job, how, crc) -> None:
    spec, box, host, cell, cbox, _ = job
    full_off = tuple(i * c for i, c in zip(cell, spec.chunks))
    if how == "whole":
        if crc32c.crc32c(raw) != crc:
            raise CheckpointCorrupt(key, f"object fails its crc32c checksum ({len(raw)} bytes read)")
        if not spec.inner_rows:
            block = decode_block(key, raw, spec.chunks, spec, "chunk")
            _copy(host, box, block, Box(full_off, spec.chunks))
            return
        n = index_nbytes(spec)
        if len(raw) < n:
            raise CheckpointCorrupt(key, "shard truncated")
        index = decode_index(key, raw[len(raw) - n:], spec)
        rows = spec.inner_rows
        pieces = [(k, int(index[k][0]), int(index[k][1])) for k in range(spec.n_inner)
                  if int(index[k][0]) != EMPTY]
    else:
        rows = spec.inner_rows
        pieces = how
    raw = memoryview(raw)
    for k, off, nb in pieces:
        chunk_raw = raw[off:off + nb]
        block = decode_block(key, chunk_raw, spec.inner_shape, spec, f"inner chunk {k}",
                             checked=how == "whole")
        inner_off = (full_off[0] + k * rows, *full_off[1:])
        _copy(host, box, block, Box(inner_off, spec.inner_shape))


def _apply_values(st, d: str, manifest: dict, state: dict, rank: int) -> None:
    key = f"values/rank-{rank:05d}.json"
    if key not in manifest["objects"]:
        key = "values/rank-00000.json"
    obj = manifest["objects"].get(key)
    if obj is None:
        return
    raw = _read(st, [(f"{d}/{key}", 0, int(obj["size"]))])[0]
    if crc32c.crc32c(raw) != int(obj["crc32c"]):
        raise CheckpointCorrupt(f"{d}/{key}", "fails its crc32c checksum")
    _merge(state, json.loads(raw))


def _merge(state: dict, saved: dict) -> None:
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            _merge(state[k], v)
        elif not isinstance(state.get(k), torch.Tensor):
            state[k] = v


def verify_step(st, d: str) -> tuple[list[str], int, int]:
    """Re-read every object of a committed step; (problems, objects, bytes)."""
    try:
        manifest = read_manifest(st, d)
    except (CheckpointNotFound, CheckpointCorrupt) as exc:
        return [str(exc)], 0, 0
    problems: list[str] = []
    for name, meta in manifest["arrays"].items():
        spec = ArraySpec.from_json(name, meta)
        if spec.dtype not in TORCH_DTYPES:
            problems.append(f"{name}: unknown dtype {spec.dtype}")
        if any(n == 0 for n in spec.shape):
            continue
        for cell in layout.all_cells(spec.shape, spec.chunks):
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
        return None, len(raw)

    total = 0
    for problem, n in st._pool.map(one, keys):
        total += n
        if problem:
            problems.append(problem)
    return problems, len(keys), total

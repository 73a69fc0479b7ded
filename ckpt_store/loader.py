"""The read side: manifest, load into this rank's layout, verify.

``load_step`` reads only the chunks (and, inside sharded chunks, only the
inner chunks) that intersect this rank's box of each target tensor; every
piece read is checked against its crc32c. All mismatched or missing keys
are reported at once, before anything is read.
"""

from __future__ import annotations

import json
import math

import crc32c
import torch
from torch.distributed.tensor import DTensor

from ckpt_store import layout
from ckpt_store.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound
from ckpt_store.layout import Box
from ckpt_store.plan import flatten, local_pieces
from ckpt_store.zarr_format import (EMPTY, TORCH_DTYPES, ArraySpec, chunk_key, decode_index,
                                    dtype_name, index_nbytes, tensor_bytes)

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
    # phase 1: the shard index of every sharded chunk this rank needs
    sharded = sorted({(j[0].name, j[3]): j for j in jobs if j[0].inner_rows}.values(), key=lambda j: j[0].name)
    index_reqs = []
    for spec, _, _, cell, _, _ in sharded:
        key = chunk_key(spec.name, cell)
        size = int(_obj(manifest, d, key)["size"])
        index_reqs.append((f"{d}/{key}", size - index_nbytes(spec), size))
    indexes = {}
    for (spec, _, _, cell, _, _), req, raw in zip(sharded, index_reqs, _read(st, index_reqs)):
        stats["bytes_read"] += len(raw)
        indexes[(spec.name, cell)] = decode_index(req[0], raw, spec)
    # phase 2: data, read straight into the target where a block lands contiguously in it
    reads, blocks = [], []
    for job in jobs:
        spec, box, host, cell, cbox, inter = job
        key = f"{d}/{chunk_key(spec.name, cell)}"
        full_off = tuple(i * c for i, c in zip(cell, spec.chunks))
        if not spec.inner_rows:
            size = int(_obj(manifest, d, chunk_key(spec.name, cell))["size"])
            want = math.prod(spec.chunks) * spec.itemsize + 4
            if size != want:
                raise CheckpointCorrupt(key, f"object has {size} bytes in the manifest, expected {want}")
            spans = [(None, 0, want, Box(full_off, spec.chunks))]
        else:
            index, rows = indexes[(spec.name, cell)], spec.inner_rows
            lo = inter.offset[0] - cbox.offset[0]
            hi = lo + inter.shape[0]
            spans = []
            for k in range(lo // rows, -(-hi // rows)):
                off, nb = int(index[k][0]), int(index[k][1])
                if off == EMPTY:
                    raise CheckpointCorrupt(key, "an inner chunk the layout needs is absent")
                spans.append((k, off, nb, Box((full_off[0] + k * rows, *full_off[1:]), spec.inner_shape)))
        for group in _contiguous(spans):
            bufs = []
            for k, _, nb, bbox in group:
                blk = _Block(key, spec, k, nb, bbox, box, host)
                bufs += [blk.data, blk.crc]
                blocks.append(blk)
            reads.append((key, group[0][1], bufs, sum(g[2] for g in group)))
    try:
        got = st.read_into([(k, start, bufs) for k, start, bufs, _ in reads])
    except FileNotFoundError as exc:
        raise CheckpointCorrupt(str(exc.filename or exc), "object missing") from exc
    for (key, _, _, want), n in zip(reads, got):
        if n != want:
            raise CheckpointCorrupt(key, f"object truncated ({n} of {want} bytes read)")
        stats["bytes_read"] += n
        stats["objects"] += 1
    for blk in st._pool.map(_Block.check, blocks):
        blk.place()
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


def _contiguous(spans: list) -> list[list]:
    """Group (k, offset, nbytes, box) spans into runs that lie back to back in the object."""
    groups: list[list] = []
    for sp in spans:
        if groups and groups[-1][-1][1] + groups[-1][-1][2] == sp[1] and len(groups[-1]) < 256:
            groups[-1].append(sp)
        else:
            groups.append([sp])
    return groups


class _Block:
    """One encoded (inner) chunk to read: into the target directly when it lies whole and
    contiguous inside it, else into a scratch buffer copied over after its check."""

    def __init__(self, key: str, spec: ArraySpec, k, nbytes: int, block: Box, box: Box,
                 host: torch.Tensor):
        self.key, self.spec, self.what = key, spec, "chunk" if k is None else f"inner chunk {k}"
        self.block, self.box, self.host = block, box, host
        want = block.numel * spec.itemsize
        if nbytes != want + 4:
            raise CheckpointCorrupt(key, f"{self.what} has {nbytes} bytes, expected {want + 4}")
        dest = None
        if box.contains(block):
            view = host[block.slices(box.offset)]
            if view.is_contiguous():
                dest = view
        self.direct = dest is not None
        self.tensor = dest if dest is not None else torch.empty(block.shape, dtype=host.dtype)
        self.data = tensor_bytes(self.tensor) if want else bytearray(0)
        self.crc = bytearray(4)

    def check(self) -> "_Block":
        if crc32c.crc32c(self.data) != int.from_bytes(self.crc, "little"):
            raise CheckpointCorrupt(self.key, f"{self.what} fails its crc32c checksum")
        return self

    def place(self) -> None:
        if self.direct:
            return
        inter = self.box.intersect(self.block)
        if inter is not None:
            self.host[inter.slices(self.box.offset)] = self.tensor[inter.slices(self.block.offset)]


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

"""The read side: manifest, load into this rank's layout, verify.

``load_step`` reads only the chunks (and, inside sharded chunks, only the
inner chunks) that intersect this rank's box of each target tensor; every
piece read is checked against its crc32c, in its I/O thread as soon as its
read is over (``_landed``: on a local disk the checks overlap the other reads;
an object store's ranged GETs are one batch, and the checks follow it), and a chunk object read whole
against the manifest's ``chunks_crc32c`` too. All mismatched or missing keys
are reported at once, before anything is read.
"""

from __future__ import annotations

import errno
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import crc32c
import numpy as np
import torch

from ckpt_store.errors import (
    CheckpointCorrupt,
    CheckpointMismatch,
)
from ckpt_store.format import layout
from ckpt_store.format.layout import Box
from ckpt_store.format.manifest import PartShare, read_manifest
from ckpt_store.format.plan import flatten, local_pieces
from ckpt_store.format.zarr_format import (
    EMPTY,
    ArraySpec,
    chunk_key,
    chunks_digest,
    decode_index,
    dtype_name,
    index_nbytes,
    predicted_index,
    tensor_bytes,
)
from ckpt_store.log import get_logger

if TYPE_CHECKING:
    from ckpt_store.storage.protocol import Storage

log = get_logger(__name__)


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


def _tables(state: dict, prefix: str = "") -> set[str]:
    """The names of the target's tables (dicts) below the root, e.g. ``{"optim", "optim/w"}``."""
    out = set()
    for key, value in state.items():
        if isinstance(value, dict):
            name = f"{prefix}{key}"
            out.add(name)
            out |= _tables(value, name + "/")
    return out


def dropped_arrays(arrays: dict, state: dict, tensors: dict) -> list[str]:
    """Saved arrays that a load into ``state`` would silently leave behind, one problem line each.

    A table the target has (say ``optim``, or a plain ``optimizer.state_dict()``'s ``state``,
    empty in a fresh Adam) is loaded whole: a saved array under it without a tensor in the
    target would be dropped. Arrays under tables the target does not name at all are not
    asked for (loading only ``model`` is fine).
    """
    tables = _tables(state)
    out = []
    for name in sorted(arrays):
        parts = name.split("/")
        if name in tensors or not any("/".join(parts[:i]) in tables for i in range(1, len(parts))):
            continue
        out.append(f"{name}: saved, but the target has no tensor for it (it would be dropped); "
                   f"give the target every saved entry, e.g. initialise the optimizer's state first")
    return out


def _obj(manifest: dict, d: str, key: str) -> dict:
    obj = manifest["objects"].get(key)
    if obj is None:
        raise CheckpointCorrupt(f"{d}/{key}", "listed by no manifest entry (missing object)")
    return obj


def load_step(st: Storage, d: str, state: dict, rank: int, values: bool = True,
              share: PartShare | None = None) -> dict:
    """Fill ``state`` in place from step dir ``d``; returns read statistics. ``share``: every
    rank loads this step now and they share the reading of its object lists (``read_manifest``)."""
    manifest = read_manifest(st, d, share)
    step = manifest.get("step", -1)
    tensors, _ = flatten(state)
    problems = [p for p in (_check(n, t, manifest["arrays"]) for n, t in sorted(tensors.items())) if p]
    if values:      # a whole load (not load_arrays' pick of single arrays): nothing saved is left out
        problems += dropped_arrays(manifest["arrays"], state, tensors)
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
        # the same memory without autograd: blocks are placed in the I/O threads, where grad
        # mode is on whatever the caller's is, and a target may be an nn.Parameter
        local = local.detach()
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
    indexes, predicted = _shard_indexes(st, manifest, d, jobs, stats)
    # data, read straight into the target where a block lands contiguously in it; on a local
    # disk each read starts as soon as it is planned (``_plan_reads``), so the disk works
    # while the rest is planned
    reads: list = []    # (key, start, buffers, bytes wanted, blocks), in the order started
    blocks: list = []
    tails: dict[str, bytearray] = {}    # predicted shard index -> the buffer it is read into
    saved_values = _values_read(manifest, d, rank, reads) if values else None   # read in the same batch
    planned = _plan_reads(st, manifest, d, jobs, indexes, predicted, reads, blocks, tails)
    def landed(i: int, n: int) -> None:     # in the read's I/O thread: its shard index, then its blocks
        key, _start, bufs, want, _blocks = reads[i]
        if n == want and key in predicted and bufs[-1] is tails.get(key):
            indexes[key] = _checked_index(key, tails[key], *predicted[key][:2])
        _landed(reads[i], n)

    got = _storage_read(st, manifest, d, lambda reqs: st.read_into(reqs, done=landed),
                        planned if st.local else list(planned), keys=lambda: [r[0] for r in reads])
    stats["bytes_read"] += sum(got) - (got[0] if saved_values else 0)
    stats["objects"] += sum(1 for r in reads if r[4])
    _check_whole_objects(manifest, d, blocks, indexes)
    for local, host in hosts:
        local.copy_(host)
    if saved_values:
        _apply_values(*saved_values, state)
    return stats


def _shard_indexes(st: Storage, manifest: dict, d: str, jobs: list, stats: dict) -> tuple[dict, dict]:
    """The shard index of every sharded chunk object the ``jobs`` need: where the object's
    size is one marind writes, the index is known from it (``predicted_index``: read with the
    data and checked after it, ``_plan_reads``); else (another writer's layout) it is read
    here, first. Returns ({key: (index, its crc32c tail)}, {key: (spec, predicted index, the
    index's offset)})."""
    sharded = sorted({(j[0].name, j[3]): j for j in jobs if j[0].inner_rows}.values(), key=lambda j: j[0].name)
    first = []
    indexes: dict = {}
    predicted: dict[str, tuple[ArraySpec, np.ndarray, int]] = {}
    for spec, _, _, cell, _, _ in sharded:
        key = chunk_key(spec.name, cell)
        size = int(_obj(manifest, d, key)["size"])
        req = (f"{d}/{key}", size - index_nbytes(spec), size)
        guess = predicted_index(spec, size)
        if guess is None:
            first.append((spec, req))
        else:
            predicted[req[0]] = (spec, guess, req[1])
            indexes[req[0]] = (guess, b"")
    for (spec, req), raw in zip(first, _read(st, manifest, d, [r for _, r in first])):
        stats["bytes_read"] += len(raw)
        indexes[req[0]] = (decode_index(req[0], raw, spec), raw[-4:])
    return indexes, predicted


def _plan_reads(st: Storage, manifest: dict, d: str, jobs: list, indexes: dict, predicted: dict,
                reads: list, blocks: list, tails: dict) -> Iterator[tuple[str, int, list]]:
    """Yield the reads already in ``reads``, then the data's (key, start, buffers) one by one
    as they are planned, each appended to ``reads`` (with its bytes wanted and its blocks)
    and its blocks to ``blocks`` first. A predicted shard index (``predicted``) is read into
    ``tails[key]`` by the read of the data that ends where it starts (one read for a whole
    object, the layout ``encode_chunk`` writes), else by a read of its own after the
    object's last job; either way as the last buffer of its read, checked when it lands."""
    for queued in list(reads):       # reads queued before the data's (the JSON values)
        yield queued[:3]
    left = Counter(k for k in (f"{d}/{chunk_key(j[0].name, j[3])}" for j in jobs) if k in predicted)
    for spec, box, host, cell, cbox, inter in jobs:
        key = f"{d}/{chunk_key(spec.name, cell)}"
        full_off = tuple(i * c for i, c in zip(cell, spec.chunks))
        if not spec.inner_rows:
            size = int(_obj(manifest, d, chunk_key(spec.name, cell))["size"])
            want = math.prod(spec.chunks) * spec.itemsize + 4
            if size != want:
                raise CheckpointCorrupt(key, f"object has {size} bytes in the manifest, expected {want}")
            spans: list[tuple[int | None, int, int, Box]] = [(None, 0, want, Box(full_off, spec.chunks))]
        else:
            (index, _), rows = indexes[key], spec.inner_rows
            lo = inter.offset[0] - cbox.offset[0]
            hi = lo + inter.shape[0]
            spans = []
            for k in range(lo // rows, -(-hi // rows)):
                off, nb = int(index[k][0]), int(index[k][1])
                if off == EMPTY:
                    raise CheckpointCorrupt(key, "an inner chunk the layout needs is absent")
                spans.append((k, off, nb, Box((full_off[0] + k * rows, *full_off[1:]), spec.inner_shape)))
        for group in _contiguous(spans, READ_GROUP_BYTES if st.local else None):
            bufs, group_blocks = [], []
            for k, off, nb, bbox in group:
                blk = _Block(key, spec, k, off, nb, bbox, box, host)
                bufs += [blk.data, blk.crc]
                group_blocks.append(blk)
            want = sum(g[2] for g in group)
            if key in predicted and key not in tails and group[-1][1] + group[-1][2] == predicted[key][2]:
                tails[key] = bytearray(index_nbytes(spec))
                bufs.append(tails[key])
                want += len(tails[key])
            blocks += group_blocks
            reads.append((key, group[0][1], bufs, want, group_blocks))
            yield reads[-1][:3]
        if key in predicted:
            left[key] -= 1
            if not left[key] and key not in tails:     # no read of the data ran into the index
                tails[key] = bytearray(index_nbytes(spec))
                reads.append((key, predicted[key][2], [tails[key]], len(tails[key]), []))
                yield reads[-1][:3]


def _landed(read: tuple, n: int) -> None:
    """One read of phase 2 is over (``n`` bytes): check it now, in its I/O thread, while the
    other reads go on (local disks; ``Storage.read_into``). A short read is a truncated object; every block of it must pass its
    crc32c before it is copied into the target (a block read straight into the target is
    there already: the load then raises before it returns)."""
    key, _start, _bufs, want, group_blocks = read
    if n != want:
        raise CheckpointCorrupt(key, f"object truncated ({n} of {want} bytes read)")
    with torch.no_grad():
        for blk in group_blocks:
            blk.check()
            blk.place()


def _checked_index(key: str, raw: bytearray, spec: ArraySpec, guess: np.ndarray) -> tuple[np.ndarray, bytes]:
    """A shard index read with the data (in its I/O thread): the one its object's size implies,
    else CheckpointCorrupt. Returns (index, its crc32c tail)."""
    index = decode_index(key, raw, spec)
    if not np.array_equal(index, guess):
        raise CheckpointCorrupt(key, "its shard index does not match the object's size (not a layout "
                                     "this store writes)")
    return index, bytes(raw[-4:])


def _read(st: Storage, manifest: dict, d: str, reqs: list[tuple[str, int, int]]) -> list[bytes]:
    return _storage_read(st, manifest, d, st.read_ranges, reqs)


def _storage_read(st: Storage, manifest: dict, d: str, read, reqs: Iterable,
                  keys: Callable[[], list[str]] | None = None) -> list:
    """``read(reqs)``: ranged reads of objects of step dir ``d`` (``keys()``: the keys of
    ``reqs``, where ``reqs`` is an iterator consumed by the read). An object that is missing or
    shorter than the manifest says raises CheckpointCorrupt naming it. A local disk reads a
    short object short (the caller checks), but S3 refuses a range past its end (HTTP 416:
    OSError EINVAL), and a batch's error need not name its object: then each object of the
    batch is looked at once. Other errors (the storage unreachable or refusing) are raised as
    they came: they say nothing about this step, which must not be skipped or quarantined."""
    try:
        return read(reqs)
    except OSError as exc:
        if not (isinstance(exc, FileNotFoundError) or exc.errno == errno.EINVAL):
            raise
        bad = _find_bad_object(st, manifest, d, keys() if keys else [r[0] for r in reqs], exc)
        if bad is None:
            raise
        log.warning("ckpt_object_corrupt", object=bad.object, reason=bad.reason)
        raise bad from exc


def _find_bad_object(st: Storage, manifest: dict, d: str, keys: list[str], exc: OSError) -> CheckpointCorrupt | None:
    """The first of ``keys`` that is missing or not the size the manifest lists (the object
    the error names, if any, first); None when every one is whole."""
    def probe(key: str) -> CheckpointCorrupt | None:
        want = manifest["objects"].get(key[len(d) + 1:], {}).get("size")
        try:
            size = st.size(key)
        except FileNotFoundError:
            return CheckpointCorrupt(key, "object missing")
        if size != want:
            return CheckpointCorrupt(key, f"truncated or unreadable: {size} bytes where the manifest "
                                          f"lists {want} ({exc})")
        return None

    keys = sorted(set(keys))
    named = [k for k in keys if exc.filename and st.path(k) == exc.filename]
    for found in map(probe, named):
        if found is not None:
            return found
    return next((f for f in st.pool().map(probe, [k for k in keys if k not in named]) if f), None)


def _check_whole_objects(manifest: dict, d: str, blocks: list, indexes: dict) -> None:
    """Check every chunk object this rank read all of against the manifest's ``chunks_crc32c``
    (``zarr_format.chunks_digest``). Each piece's own crc32c passes an object that is whole
    but not this save's (a chunk copied in from another step, a stale read of an overwritten
    object), and so does the object's crc32c, which depends on its pieces' lengths only. A
    rank that reads part of an object (a reshard) cannot tell; ``verify`` reads them whole."""
    by_key: dict[str, dict] = {}
    for blk in blocks:
        by_key.setdefault(blk.key, {}).setdefault(blk.k, blk)
    for key, got in sorted(by_key.items()):
        obj = manifest["objects"][key[len(d) + 1:]]
        if "chunks_crc32c" not in obj:
            continue    # written before the field existed
        tail = []
        if key in indexes:
            index, index_tail = indexes[key]
            if set(got) != {k for k in range(len(index)) if int(index[k][0]) != EMPTY}:
                continue
            tail = [index_tail]
        parts = sorted(got.values(), key=lambda b: b.offset)
        end = 0
        for blk in parts:
            if blk.offset != end:
                break
            end += len(blk.data) + 4
        else:
            if chunks_digest([b.crc for b in parts] + tail) != obj["chunks_crc32c"]:
                log.warning("ckpt_object_corrupt", object=key, reason="not the object the manifest lists")
                raise CheckpointCorrupt(key, "holds other data than the manifest lists, though every "
                                             "chunk passes its checksum: an object of another save")


#: the most bytes one read of phase 2 gathers from back-to-back inner chunks on a local
#: disk: a read is checked as soon as it is over, so reads this size spread one large shard
#: over the I/O threads and keep the checks behind the other reads. An object store gets
#: one ranged GET per run (its requests are one concurrent batch, checked after it: more
#: GETs would only cost requests)
READ_GROUP_BYTES = 8 << 20


def _contiguous(spans: list, limit: int | None) -> list[list]:
    """Group (k, offset, nbytes, box) spans into runs that lie back to back in the object
    (at most 256 spans and, past the first, ``limit`` bytes a run; None: no byte limit)."""
    groups: list[list] = []
    for sp in spans:
        last = groups[-1] if groups else None
        if last and last[-1][1] + last[-1][2] == sp[1] and len(last) < 256 \
                and (limit is None or sp[1] + sp[2] - last[0][1] <= limit):
            last.append(sp)
        else:
            groups.append([sp])
    return groups


class _Block:
    """One encoded (inner) chunk to read: into the target directly when it lies whole and
    contiguous inside it, else into a scratch buffer copied over after its check."""

    def __init__(self, key: str, spec: ArraySpec, k, offset: int, nbytes: int, block: Box, box: Box,
                 host: torch.Tensor):
        self.key, self.spec, self.what = key, spec, "chunk" if k is None else f"inner chunk {k}"
        self.k, self.offset = k, offset
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

    def check(self) -> _Block:
        if crc32c.crc32c(self.data) != int.from_bytes(self.crc, "little"):
            raise CheckpointCorrupt(self.key, f"{self.what} fails its crc32c checksum")
        return self

    def place(self) -> None:
        if self.direct:
            return
        inter = self.box.intersect(self.block)
        if inter is not None:
            self.host[inter.slices(self.box.offset)] = self.tensor[inter.slices(self.block.offset)]


def _values_read(manifest: dict, d: str, rank: int, reads: list) -> tuple[str, dict, bytearray] | None:
    """The JSON values this rank gets (what the same rank number saved, else rank 0's): their
    read is put first in ``reads``, to run with the data's; (key, manifest entry, buffer), or
    None when the step saved none."""
    key = f"values/rank-{rank:05d}.json"
    if key not in manifest["objects"]:
        key = "values/rank-00000.json"
    obj = manifest["objects"].get(key)
    if obj is None:
        return None
    buf = bytearray(int(obj["size"]))
    reads.append((f"{d}/{key}", 0, [buf], len(buf), []))
    return f"{d}/{key}", obj, buf


def _apply_values(key: str, obj: dict, raw: bytearray, state: dict) -> None:
    """Check the values read (``_values_read``) against their crc32c and merge them into ``state``."""
    if crc32c.crc32c(raw) != int(obj["crc32c"]):
        raise CheckpointCorrupt(key, "fails its crc32c checksum")
    _merge(state, json.loads(raw))


def _merge(state: dict, saved: dict) -> None:
    """Fill ``state`` with saved JSON values in place. Saved keys are strings (``flatten``
    saves ``str(key)``): each goes back under the state's own key of that spelling
    (``optim[0]``, not a new ``optim["0"]``), or is added as saved."""
    spelled = {str(k): k for k in state}
    for k, v in saved.items():
        key = k if k in state else spelled.get(k, k)
        cur = state.get(key)
        if isinstance(v, dict) and isinstance(cur, dict):
            _merge(cur, v)
        elif not isinstance(cur, torch.Tensor):
            state[key] = v

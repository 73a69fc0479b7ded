"""Export a committed step as a directory of sharded safetensors files with an index.

The layout Hugging Face ``from_pretrained`` reads: ``model-0000i-of-0000n.safetensors``,
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``) and any
JSON files the caller passes (``config.json``). What goes in is generic: a list of
:class:`ExportTensor` (checkpoint array -> output name, an optional dtype-preserving
transform, and the output shape when the transform changes it, e.g. one expert of a stacked
array); a model's naming lives with the model, not here. Consecutive outputs of one array read it once.

Memory stays bounded by the largest array, not the checkpoint: each shard's header is
computed from the manifest before any data is read, then the arrays are read one at a
time, transformed, written and dropped. The directory is built under a temporary name
beside ``out`` and renamed into place, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ckpt_store.format.steps import step_dir
from ckpt_store.format.zarr_format import TORCH_DTYPES
from ckpt_store.load.loader import load_step
from ckpt_store.log import get_logger

log = get_logger(__name__)

#: torch dtype -> safetensors dtype code.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportTensor:
    """One output tensor: checkpoint array ``array`` written as ``name``.

    Attributes:
        array: the array's name in the checkpoint (``model/layers.0.attention.wq.weight``).
        name: its name in the safetensors files.
        transform: applied to the whole array before writing; must keep dtype, and shape unless
            ``shape`` is given.
        shape: the transform's output shape when it differs from the array's (e.g. one expert of a
            stacked ``[E, ...]`` array, transposed); None: the array's shape.
    """

    array: str
    name: str
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    shape: tuple[int, ...] | None = None


def parse_size(text: str) -> int:
    """Bytes of a size like ``2GB``, ``500MB``, ``64MiB`` or ``1048576`` (decimal units as HF).

    Raises:
        ValueError: not a positive size (one line with the accepted forms).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text, re.IGNORECASE)
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if n <= 0:
        raise ValueError(f"size {text!r} is not a positive size; write e.g. 2GB, 500MB, 64MiB or a byte count")
    return n


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Group tensors (in order) into shards of at most ``max_bytes``; a bigger tensor gets one alone.

    Args:
        sizes: each tensor's bytes.
        max_bytes: the shard size limit.

    Returns:
        The indices of ``sizes`` in each shard (every index exactly once, in order).
    """
    shards: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if not shards or used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def safetensors_header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    """The header of a safetensors file: 8-byte little-endian length, then JSON padded to 8 bytes.

    Args:
        entries: (name, dtype code, shape, bytes) of each tensor, in file order.
        metadata: the ``__metadata__`` strings.

    Returns:
        The header bytes; the tensors' data follows them back to back.
    """
    doc: dict = {"__metadata__": metadata}
    off = 0
    for name, code, shape, nbytes in entries:
        doc[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def check_output_dir(out: str) -> None:
    """Refuse an ``out`` that cannot become the export directory (ValueError naming the fix)."""
    path = os.path.abspath(out)
    parent = os.path.dirname(path)
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise ValueError(f"output {out} exists and is not an empty directory; pass a new directory name")
    if not os.path.isdir(parent):
        raise ValueError(f"output's parent directory {parent} does not exist; create it or pass another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output's parent directory {parent} is not writable; pass a path you can write")


def read_array(store, step: int, name: str, meta: dict) -> torch.Tensor:
    """One whole array of ``step`` on the CPU (checksums checked), read as rank 0."""
    t = torch.empty(tuple(meta["shape"]), dtype=TORCH_DTYPES[meta["dtype"]])
    state: dict = {}
    node = state
    *parents, leaf = name.split("/")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = t
    store.load_arrays(state, step)
    return t


def read_values(store, step: int) -> dict:
    """The JSON values (``extra/...``) saved with ``step``, as nested dicts (rank 0's).

    Read by this process alone, as ``load_arrays`` reads (no collectives: ``store.load``
    shares a step's object lists among the ranks of an initialized group and would wait
    for the others), so a tool may call it on one rank of a live group.
    """
    state: dict = {}
    load_step(store.storage, step_dir(step), state, 0)
    return state


def export_sharded(store, step: int, out: str, tensors: list[ExportTensor], *, files: dict[str, dict],
                   max_shard_bytes: int = 2 * 10**9, dtype: torch.dtype | None = None,
                   progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Write ``tensors`` of ``step`` as sharded safetensors with an index, plus ``files``, into ``out``.

    Args:
        store: the ``CheckpointStore``.
        step: a committed step.
        out: the directory to create (must not exist, or be empty).
        tensors: what to write, in order.
        files: file name -> JSON document written beside the shards (``config.json``).
        max_shard_bytes: the shard size limit (a bigger tensor gets a shard of its own).
        dtype: cast every floating-point array to this dtype as it is written (e.g. ``torch.bfloat16``
            for a model trained in fp32); None keeps each array's saved dtype. Integer arrays are kept.
        progress: called with (arrays done, arrays, bytes written) after each array.

    Returns:
        ``{"tensors", "bytes", "shards"}``.

    Raises:
        ValueError: a bad ``out``, an array the step lacks, two tensors of one name, or a
            transform that changed shape or dtype.
        CheckpointNotFound, CheckpointCorrupt: as ``CheckpointStore.load_arrays``.
    """
    check_output_dir(out)
    manifest = store.manifest(step)
    entries = []
    seen: set[str] = set()
    for t in tensors:
        meta = manifest["arrays"].get(t.array)
        if meta is None:
            raise ValueError(f"step {step} has no array {t.array!r}; check the step and the export's mapping")
        if t.name in seen:
            raise ValueError(f"two arrays would both be exported as {t.name!r}")
        seen.add(t.name)
        saved = TORCH_DTYPES[meta["dtype"]]
        out_dtype = dtype if dtype is not None and saved.is_floating_point else saved
        if out_dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"array {t.array!r} has dtype {meta['dtype']}, which safetensors cannot hold")
        shape = [int(s) for s in (t.shape if t.shape is not None else meta["shape"])]
        nbytes = out_dtype.itemsize
        for s in shape:
            nbytes *= s
        entries.append((t, meta, SAFETENSORS_DTYPES[out_dtype], shape, nbytes, out_dtype))
    shards = plan_shards([e[4] for e in entries], max_shard_bytes)
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(os.path.abspath(out))}"
                                                                 f".tmp-{os.getpid()}")
    weight_map: dict[str, str] = {}
    last: dict[str, torch.Tensor] = {}     # the array just read: consecutive outputs of one array read it once
    done = total = 0
    try:
        os.makedirs(tmp)
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            part = [entries[i] for i in shard]
            header = safetensors_header([(e[0].name, e[2], e[3], e[4]) for e in part],
                                        {"format": "pt", "marind_step": str(step)})
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(header)
                for spec, meta, _, shape, nbytes, out_dtype in part:
                    _write_tensor(f, store, step, spec, meta, shape, nbytes, out_dtype, last)
                    weight_map[spec.name] = fname
                    done, total = done + 1, total + nbytes
                    if progress:
                        progress(done, len(entries), total)
                f.flush()
                os.fsync(f.fileno())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        for fname, doc in {**files, INDEX_FILE: index}.items():
            with open(os.path.join(tmp, fname), "w") as f:
                json.dump(doc, f, indent=2, sort_keys=fname == INDEX_FILE)
                f.write("\n")
        if os.path.isdir(out):
            os.rmdir(out)     # empty (checked); a race that fills it fails here, not silently
        os.rename(tmp, out)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("ckpt_exported", step=step, out=out, format="sharded-safetensors", tensors=len(entries),
             shards=len(shards), bytes=total)
    return {"tensors": len(entries), "bytes": total, "shards": len(shards)}


def _write_tensor(f, store, step: int, spec: ExportTensor, meta: dict, shape: list[int], nbytes: int,
                  out_dtype: torch.dtype, last: dict[str, torch.Tensor]) -> None:
    if spec.array not in last:
        last.clear()
        last[spec.array] = read_array(store, step, spec.array, meta)
    t = last[spec.array]
    if spec.transform is not None:
        out = spec.transform(t)
        if list(out.shape) != shape or out.dtype != t.dtype:
            raise ValueError(f"the export transform of {spec.array!r} made {list(out.shape)} {out.dtype}, "
                             f"not the declared {shape} {t.dtype}; a transform must keep the dtype and give "
                             f"the declared shape")
        t = out
    if t.dtype != out_dtype:
        t = t.to(out_dtype)
    if nbytes:
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)   # no copy

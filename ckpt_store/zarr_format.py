"""Zarr v3 on-disk format, written by hand: array/group metadata, chunk keys, chunk codecs.

Every array uses codecs that zarr-python and tensorstore both read:

* small chunks:   ``bytes`` (little endian) + ``crc32c``  -> raw bytes + 4-byte crc32c
* larger chunks:  ``sharding_indexed`` whose inner chunks (rows along dim 0)
  are ``bytes`` + ``crc32c`` and whose index (uint64 offset/nbytes pairs,
  at the end) is ``bytes`` + ``crc32c``. One object per saved shard, yet a
  reader can fetch only the inner chunks it needs, each checksummed.

bfloat16 is stored as Zarr data type ``"bfloat16"`` (tensorstore reads it
natively; zarr-python 3.1 reads it once ``ckpt_store.zarr_bf16`` registered
the type).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from ckpt_store.errors import CheckpointCorrupt

DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32",
    torch.uint64: "uint64", torch.bool: "bool",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
EMPTY = (1 << 64) - 1
_BYTES_LE = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


@dataclass(frozen=True)
class ArraySpec:
    """What a reader needs to find and decode an array's objects."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    inner_rows: int | None          # None: plain chunks; else sharded with this many rows per inner chunk

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=TORCH_DTYPES[self.dtype]).element_size()

    @property
    def n_inner(self) -> int:
        return self.chunks[0] // self.inner_rows if self.inner_rows else 1

    @property
    def inner_shape(self) -> tuple[int, ...]:
        return (self.inner_rows, *self.chunks[1:]) if self.inner_rows else self.chunks

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks),
                "inner_rows": self.inner_rows}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "ArraySpec":
        return cls(name, tuple(d["shape"]), d["dtype"], tuple(d["chunks"]), d.get("inner_rows"))


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"cannot checkpoint tensors of dtype {dtype}; "
                         f"supported: {', '.join(sorted(DTYPES.values()))}") from None


def chunk_key(name: str, cell: tuple[int, ...]) -> str:
    return f"{name}/c" + "".join(f"/{i}" for i in cell)


def array_metadata(spec: ArraySpec, attributes: dict | None = None) -> dict:
    endian = [] if spec.itemsize == 1 else [_BYTES_LE]
    leaf = endian + [_CRC] if endian else [{"name": "bytes"}, _CRC]
    if spec.inner_rows:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(spec.inner_shape), "codecs": leaf,
            "index_codecs": [_BYTES_LE, _CRC], "index_location": "end"}}]
    else:
        codecs = leaf
    fill = False if spec.dtype == "bool" else (0.0 if "float" in spec.dtype else 0)
    return {"zarr_format": 3, "node_type": "array", "shape": list(spec.shape),
            "data_type": spec.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs, "attributes": attributes or {}}


def group_metadata(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def _crc_bytes(buf) -> bytes:
    return crc32c.crc32c(buf).to_bytes(4, "little")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def encode_chunk(buf: torch.Tensor, spec: ArraySpec) -> tuple[list, int, int]:
    """Encode one chunk (``buf`` = its in-bounds region) -> (pieces, size, crc32c of the object)."""
    buf = buf.contiguous()
    pieces: list = []
    if not spec.inner_rows:
        data = buf if tuple(buf.shape) == spec.chunks else _padded(buf, spec.chunks)
        raw = tensor_bytes(data)
        pieces = [raw, _crc_bytes(raw)]
    else:
        rows, valid_rows = spec.inner_rows, buf.shape[0]
        full_other = tuple(buf.shape[1:]) == spec.chunks[1:]
        index = np.full((spec.n_inner, 2), EMPTY, dtype="<u8")
        offset = 0
        for k in range(spec.n_inner):
            start = k * rows
            if start >= valid_rows:
                continue
            part = buf[start:min(start + rows, valid_rows)]
            if part.shape[0] != rows or not full_other:
                part = _padded(part, spec.inner_shape)
            raw = tensor_bytes(part)
            pieces += [raw, _crc_bytes(raw)]
            index[k] = (offset, raw.nbytes + 4)
            offset += raw.nbytes + 4
        idx = index.tobytes()
        pieces += [idx, _crc_bytes(idx)]
    crc, size = 0, 0
    for p in pieces:
        crc = crc32c.crc32c(p, crc)
        size += memoryview(p).nbytes
    return pieces, size, crc


def index_nbytes(spec: ArraySpec) -> int:
    return spec.n_inner * 16 + 4


def _check_crc(key: str, raw: memoryview, what: str) -> memoryview:
    if len(raw) < 4:
        raise CheckpointCorrupt(key, f"{what} truncated ({len(raw)} bytes)")
    body, tail = raw[:-4], raw[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        raise CheckpointCorrupt(key, f"{what} fails its crc32c checksum")
    return body


def decode_index(key: str, raw: bytes, spec: ArraySpec) -> np.ndarray:
    if len(raw) != index_nbytes(spec):
        raise CheckpointCorrupt(key, f"shard index truncated ({len(raw)} of {index_nbytes(spec)} bytes)")
    body = _check_crc(key, memoryview(raw), "shard index")
    return np.frombuffer(body, dtype="<u8").reshape(spec.n_inner, 2)


def decode_block(key: str, raw, shape: tuple[int, ...], spec: ArraySpec, what: str,
                 checked: bool = False) -> torch.Tensor:
    """Decode raw bytes + crc32c of a (plain or inner) chunk into a CPU tensor of ``shape``."""
    raw = memoryview(raw)
    want = math.prod(shape) * spec.itemsize + 4
    if len(raw) != want:
        raise CheckpointCorrupt(key, f"{what} has {len(raw)} bytes, expected {want}")
    # ``checked``: the whole object already matched the manifest's crc32c
    body = raw[:-4] if checked else _check_crc(key, raw, what)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read from it
        flat = torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)
    return flat.view(TORCH_DTYPES[spec.dtype]).reshape(shape)

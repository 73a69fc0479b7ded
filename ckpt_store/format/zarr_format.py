"""Zarr v3 on-disk format, written by hand: array/group metadata, chunk keys, chunk codecs.

Every array uses codecs that zarr-python and tensorstore both read:

* small chunks:   ``bytes`` (little endian) + ``crc32c``  -> raw bytes + 4-byte crc32c
* larger chunks:  ``sharding_indexed`` whose inner chunks (rows along dim 0)
  are ``bytes`` + ``crc32c`` and whose index (uint64 offset/nbytes pairs,
  at the end) is ``bytes`` + ``crc32c``. One object per saved shard, yet a
  reader can fetch only the inner chunks it needs, each checksummed.

bfloat16 is stored as Zarr data type ``"bfloat16"`` (tensorstore reads it
natively; zarr-python 3.1 reads it once ``ckpt_store.format.zarr_bf16`` registered
the type).

Importing this module does not import torch (the writer process encodes from
shared memory without it); the torch dtype maps load on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ckpt_store.errors import CheckpointCorrupt

if TYPE_CHECKING:
    import torch

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2,
            "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1}


_TORCH: dict = {}


def _torch_maps() -> dict:
    if not _TORCH:
        import torch

        dtypes = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                  torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16",
                  torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
                  torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
                  torch.bool: "bool"}
        _TORCH.update(DTYPES=dtypes, TORCH_DTYPES={v: k for k, v in dtypes.items()})
    return _TORCH


def __getattr__(name: str):
    """``DTYPES`` (torch dtype -> Zarr name) and ``TORCH_DTYPES`` (the reverse), built on first use."""
    if name in ("DTYPES", "TORCH_DTYPES"):
        return _torch_maps()[name]
    raise AttributeError(name)


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
        return ITEMSIZE[self.dtype]

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
    def from_json(cls, name: str, d: dict) -> ArraySpec:
        return cls(name, tuple(d["shape"]), d["dtype"], tuple(d["chunks"]), d.get("inner_rows"))


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _torch_maps()["DTYPES"][dtype]
    except KeyError:
        raise ValueError(f"cannot checkpoint tensors of dtype {dtype}; "
                         f"supported: {', '.join(sorted(ITEMSIZE))}") from None


def chunk_key(name: str, cell: tuple[int, ...]) -> str:
    return f"{name}/c" + "".join(f"/{i}" for i in cell)


def array_metadata(spec: ArraySpec, attributes: dict | None = None) -> dict:
    endian: list[dict[str, Any]] = [] if spec.itemsize == 1 else [_BYTES_LE]
    leaf: list[dict[str, Any]] = endian + [_CRC] if endian else [{"name": "bytes"}, _CRC]
    codecs: list[dict[str, Any]]
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


def tensor_bytes(t) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def slot_nbytes(spec: ArraySpec) -> int:
    """Bytes of one whole (padded) chunk in memory."""
    return math.prod(spec.chunks) * spec.itemsize


def chunks_digest(crcs) -> int:
    """The manifest's ``chunks_crc32c`` of a chunk object: the crc32c of the 4-byte crc32c
    that ends each of its encoded pieces (inner chunks in object order, then the shard index).
    The object's own crc32c cannot tell two objects of one shape apart: each piece ends in
    the crc32c of its body, so by CRC's residue property the crc32c of the whole depends on
    the pieces' lengths only. This one changes with the data."""
    return crc32c.crc32c(b"".join(bytes(c) for c in crcs))


def embedded_crcs(key: str, raw, spec: ArraySpec) -> list:
    """The crc32c tails of a whole chunk object's pieces, in object order (for ``chunks_digest``)."""
    raw = memoryview(raw)
    if not spec.inner_rows:
        return [raw[-4:]]
    n = index_nbytes(spec)
    index = decode_index(key, raw[max(0, len(raw) - n):], spec)
    spans = sorted((int(off), int(nb)) for off, nb in index if int(off) != EMPTY)
    tails = []
    for off, nb in spans:
        if nb < 4 or off + nb > len(raw) - n:
            raise CheckpointCorrupt(key, f"shard index points past the data (offset {off}, {nb} bytes)")
        tails.append(raw[off + nb - 4:off + nb])
    return tails + [raw[-4:]]


def encode_chunk(buf, spec: ArraySpec, valid_rows: int) -> tuple[list, int, int, int]:
    """Encode one chunk -> (pieces, size, crc32c of the object, ``chunks_digest``).

    ``buf``: the whole chunk, C order, zero-padded past the array's edge (as
    Zarr stores edge chunks); ``valid_rows``: rows (dim 0) inside the array.
    Sharded chunks skip inner chunks wholly past the edge (index: EMPTY).
    """
    buf = memoryview(buf).cast("B")
    pieces: list = []
    if not spec.inner_rows:
        pieces = [buf, _crc_bytes(buf)]
    else:
        rows = spec.inner_rows
        inner = buf.nbytes // spec.n_inner
        index = np.full((spec.n_inner, 2), EMPTY, dtype="<u8")
        offset = 0
        for k in range(spec.n_inner):
            if k * rows >= valid_rows:
                continue
            raw = buf[k * inner:(k + 1) * inner]
            pieces += [raw, _crc_bytes(raw)]
            index[k] = (offset, raw.nbytes + 4)
            offset += raw.nbytes + 4
        idx = index.tobytes()
        pieces += [idx, _crc_bytes(idx)]
    crc, size = 0, 0
    for p in pieces:
        crc = crc32c.crc32c(p, crc)
        size += memoryview(p).nbytes
    return pieces, size, crc, chunks_digest(pieces[1::2])


def index_nbytes(spec: ArraySpec) -> int:
    return spec.n_inner * 16 + 4


def predicted_index(spec: ArraySpec, size: int) -> np.ndarray | None:
    """The shard index ``encode_chunk`` writes for a sharded chunk object of ``size`` bytes
    (pure): its inner chunks back to back from offset 0, each with its crc32c, the ones
    wholly past the array's edge absent. A reader that knows the object's size from the
    manifest can so read the data without waiting for the index, and check the index later.

    Returns:
        ``[n_inner, 2]`` (offset, bytes) rows, EMPTY for an absent inner chunk; None when
        ``size`` is not one ``encode_chunk`` writes (the caller reads the index first).
    """
    piece = math.prod(spec.inner_shape) * spec.itemsize + 4
    body = size - index_nbytes(spec)
    if body < 0 or body % piece or body // piece > spec.n_inner:
        return None
    index = np.full((spec.n_inner, 2), EMPTY, dtype="<u8")
    for k in range(body // piece):
        index[k] = (k * piece, piece)
    return index


def _check_crc(key: str, raw: memoryview, what: str) -> memoryview:
    if len(raw) < 4:
        raise CheckpointCorrupt(key, f"{what} truncated ({len(raw)} bytes)")
    body, tail = raw[:-4], raw[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        raise CheckpointCorrupt(key, f"{what} fails its crc32c checksum")
    return body


def decode_index(key: str, raw, spec: ArraySpec) -> np.ndarray:
    if len(raw) != index_nbytes(spec):
        raise CheckpointCorrupt(key, f"shard index truncated ({len(raw)} of {index_nbytes(spec)} bytes)")
    body = _check_crc(key, memoryview(raw), "shard index")
    return np.frombuffer(body, dtype="<u8").reshape(spec.n_inner, 2)

"""Token datasets (``.bin`` + ``.idx``) and the deterministic sampler.

Format (written by ``marind data prepare``, read through ``numpy.memmap``):

* ``{prefix}.bin``: every document's tokens back to back, little-endian
  uint16 (vocab <= 65536) or uint32.
* ``{prefix}.idx``: a 64-byte header ``MRNDIDX1`` + uint32 version,
  uint32 bytes per token, uint64 vocab size, uint64 documents, uint64
  tokens, 24 reserved bytes; then ``documents + 1`` int64 token offsets.

Sampling is a pure function of ``(seed, global sample index)``: the token
stream is cut into windows of ``seq_len + 1`` tokens, each epoch visits
them in a permutation seeded by ``(seed, epoch)``. The data position in a
checkpoint is the number of samples consumed; step ``s`` of any layout
reads samples ``[position, position + global_batch)``, and a data-parallel
rank takes its contiguous ``micro_batch`` slice of each accumulation step.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"MRNDIDX1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ24x")  # 64 bytes


@dataclass(frozen=True)
class IndexHeader:
    """The fixed header of ``prefix.idx``: token width, vocabulary, document and token counts."""

    token_bytes: int
    vocab_size: int
    documents: int
    tokens: int


def write_dataset(prefix: str | Path, documents, vocab_size: int) -> IndexHeader:
    """Write token documents (iterables of ints) as ``prefix.bin`` / ``prefix.idx`` (atomically)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    offsets = [0]
    tmp_bin = prefix.with_name(prefix.name + ".bin.tmp")
    with open(tmp_bin, "wb") as fh:
        for doc in documents:
            arr = np.asarray(doc, dtype=dtype)
            fh.write(arr.tobytes())
            offsets.append(offsets[-1] + len(arr))
    header = IndexHeader(np.dtype(dtype).itemsize, vocab_size, len(offsets) - 1, offsets[-1])
    tmp_idx = prefix.with_name(prefix.name + ".idx.tmp")
    with open(tmp_idx, "wb") as fh:
        fh.write(_HEADER.pack(MAGIC, VERSION, header.token_bytes, header.vocab_size,
                              header.documents, header.tokens))
        fh.write(np.asarray(offsets, dtype=np.int64).tobytes())
    tmp_bin.replace(prefix.with_name(prefix.name + ".bin"))
    tmp_idx.replace(prefix.with_name(prefix.name + ".idx"))
    return header


def read_header(prefix: str | Path) -> IndexHeader:
    """Read ``prefix.idx``'s header.

    Args:
        prefix: the dataset's path without ``.bin`` / ``.idx``.

    Returns:
        The header.

    Raises:
        FileNotFoundError: there is no index (the data was not prepared).
        ValueError: the index is truncated or not a marind dataset index.
    """
    path = Path(f"{prefix}.idx")
    try:
        raw = path.read_bytes()[:_HEADER.size]
    except OSError as exc:
        raise FileNotFoundError(f"dataset index {path} not found: run `marind data prepare` first") from exc
    if len(raw) < _HEADER.size:
        raise ValueError(f"{path} is truncated; prepare the data again")
    magic, version, token_bytes, vocab, docs, tokens = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or token_bytes not in (2, 4):
        raise ValueError(f"{path} is not a marind dataset index (format {VERSION}); prepare the data again")
    return IndexHeader(token_bytes, vocab, docs, tokens)


class TokenDataset:
    """Memory-mapped tokens of a prepared dataset."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        self.header = read_header(prefix)
        dtype = np.uint16 if self.header.token_bytes == 2 else np.uint32
        self.tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r", shape=(self.header.tokens,))
        self.offsets = np.memmap(f"{prefix}.idx", dtype=np.int64, mode="r", offset=_HEADER.size,
                                 shape=(self.header.documents + 1,))

    @property
    def vocab_size(self) -> int:
        """The vocabulary size the data was prepared with."""
        return self.header.vocab_size


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Training windows (``seq_len`` inputs + 1 target) in ``n_tokens`` tokens."""
    return (n_tokens - 1) // seq_len


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, windows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(windows)


def sample_window(seed: int, index: int, windows: int) -> int:
    """Window number of global sample ``index``: a pure function of (seed, index)."""
    epoch, j = divmod(index, windows)
    return int(_permutation(seed, epoch, windows)[j])


def rank_sample_indices(position: int, *, micro_step: int, micro_batch: int, dp_rank: int,
                        dp_size: int) -> range:
    """Global sample indices of one micro-batch of one data-parallel rank."""
    start = position + micro_step * micro_batch * dp_size + dp_rank * micro_batch
    return range(start, start + micro_batch)


class Sampler:
    """Turns global sample indices into (input, target) token batches."""

    def __init__(self, dataset: TokenDataset, seq_len: int, seed: int):
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        self.windows = num_windows(dataset.header.tokens, seq_len)
        if self.windows < 1:
            raise ValueError(f"dataset {dataset.prefix} has {dataset.header.tokens} tokens, fewer than "
                             f"data.seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")

    def batch(self, indices: Iterable[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows of global sample ``indices``, on ``device``."""
        rows = []
        for i in indices:
            w = sample_window(self.seed, i, self.windows)
            start = w * self.seq_len
            rows.append(np.asarray(self.dataset.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        t = torch.from_numpy(np.stack(rows))
        return t[:, :-1].to(device, non_blocking=True), t[:, 1:].to(device, non_blocking=True)

"""Read a W&B run file (``run-ID.wandb``) back: its history rows, with W&B's own record protos.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then records
in LevelDB's log format (32 KiB blocks; each chunk a 7-byte header: CRC-32, length, type
FULL/FIRST/MIDDLE/LAST; a block's tail shorter than a header is padding). Each whole record
is a ``wandb_internal_pb2.Record``; the ``history`` ones hold the logged rows.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(data: bytes) -> list[bytes]:
    """The whole records of a ``.wandb`` file's bytes (CRC-checked)."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (no :W&B header)")
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):            # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"bad CRC at byte {pos}")
        pos += HEADER + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            out.append(parts)
    return out


def history_rows(path: Path) -> list[dict]:
    """The rows a W&B run logged (``run.log``), each ``{key: value}`` with W&B's own keys (``_step``...)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path.read_bytes()):
        rec = pb.Record.FromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows

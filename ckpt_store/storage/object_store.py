"""The object-store backend over fsspec (s3://, memory://, any other fsspec URL).

Every PUT to S3 carries the object's crc32c (``x-amz-checksum-crc32c``), so the
server refuses a body that differs from what was checksummed, and S3 stores
default to unsigned payloads (``s3_defaults``). Range reads are batched
(s3fs runs them concurrently). Listings and sizes drop fsspec's directory
cache first: other processes write the same store.

Retries (an S3 that pushes back: 503 SlowDown, 500, resets, timeouts) are botocore's and
s3fs's, configured here, never a third loop of our own: botocore's "standard" mode
(``S3_RETRIES``: up to ``total_max_attempts`` attempts per request, exponential backoff with
full jitter capped at 20 s, and its retry quota, which stops retrying once a client's retries
keep failing, so a storm is not amplified), and s3fs's own loop (which alone retries a body
cut short on reading, and SlowDown once more) at ``S3FS_RETRIES`` tries instead of its 5, which
would multiply botocore's budget. One request's budget is then at most ``S3FS_RETRIES`` x
(``total_max_attempts`` - 1) backoffs (about 70 s expected, 140 s at worst); a save whose
requests run out of it fails alone (the ranks agree, training goes on), and the commit's own
polls retry until ``commit_timeout_s``.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterable
from typing import Any

from ckpt_store.storage.base import StorageBase, json_bytes, run_all

#: botocore's retry settings for S3 stores (the caller's ``config_kwargs["retries"]`` wins, and
#: so does each one's environment variable, botocore's own: ``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS``)
S3_RETRIES = {"mode": "standard", "total_max_attempts": 8}
_RETRY_ENV = {"mode": "AWS_RETRY_MODE", "total_max_attempts": "AWS_MAX_ATTEMPTS"}
#: s3fs's own tries around each botocore call (its default, 5, multiplies botocore's budget)
S3FS_RETRIES = 2


def s3_defaults(url: str, storage_options: dict | None) -> dict:
    """``storage_options`` with ckpt_store's defaults for S3 filled in where the caller set none.

    Payload signing off: every object a save writes carries its crc32c in the signed
    ``x-amz-checksum-crc32c`` header, which the server checks against the body, so
    SHA-256 over the body (botocore's default on plain-http endpoints; on https it
    already skips it when a checksum header is present) only buys a second hash of
    every byte on both ends: CPU on the client and the server, and wall time (figures:
    docs/perf.md, "Checkpoints: S3"). A caller who wants the
    body signed anyway sets ``config_kwargs={"s3": {"payload_signing_enabled": True}}``.

    Args:
        url: the store URL (only s3:// and s3a:// URLs get defaults).
        storage_options: the caller's fsspec options (not changed).

    Returns:
        A new dict of options.
    """
    opts = dict(storage_options or {})
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return opts
    config = dict(opts.get("config_kwargs") or {})
    s3 = dict(config.get("s3") or {})
    s3.setdefault("payload_signing_enabled", False)
    config["s3"] = s3
    if "retries" not in config:          # backoff with jitter, bounded: see the module docstring
        config["retries"] = {k: v for k, v in S3_RETRIES.items() if not os.environ.get(_RETRY_ENV[k])}
    opts["config_kwargs"] = config
    return opts


class FsspecStorage(StorageBase):
    """A store root on an fsspec filesystem that is not local (see ``storage.Storage``)."""

    local = False

    def __init__(self, url: str, fs: Any, root: str, io_threads: int = 4, rate_limit: float | None = None):
        super().__init__(url, fs, root, io_threads, rate_limit)
        if self.s3:
            fs.retries = S3FS_RETRIES       # s3fs's loop around botocore's (see the module docstring)

    # -- writes --------------------------------------------------------------------------
    def write(self, key: str, pieces: list, crc: int | None = None) -> None:
        """Write one object from ``pieces`` (one PUT). ``crc``: the object's crc32c, if the
        caller has it; S3 then checks the upload against it (``x-amz-checksum-crc32c``: end
        to end, from the snapshot to the server, and botocore need not checksum the body again)."""
        nbytes = sum(memoryview(p).nbytes for p in pieces)
        self._throttle(nbytes)
        extra = {}
        if crc is not None and self.s3:
            extra["ChecksumCRC32C"] = base64.b64encode(int(crc).to_bytes(4, "big")).decode()
        self.fs.pipe_file(self.path(key), b"".join(pieces), **extra)

    def make_durable(self, keys: list[str]) -> None:
        """Nothing to do: a PUT is durable."""

    def write_json_atomic(self, key: str, obj: Any) -> None:
        """Write ``obj`` as JSON (an S3 PUT is atomic)."""
        self.fs.pipe_file(self.path(key), json_bytes(obj))

    # -- reads ---------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object ``key``."""
        return self.fs.cat_file(self.path(key))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Read [start, end) of each key, concurrently; short reads come back short (the
        caller checks); the first failure is raised."""
        if not ranges:
            return []
        paths = [self.path(k) for k, _, _ in ranges]
        out = self.fs.cat_ranges(paths, [s for _, s, _ in ranges], [e for _, _, e in ranges],
                                 on_error="return")
        for item in out:
            if isinstance(item, FileNotFoundError):
                raise item
            if isinstance(item, Exception):
                raise item
        return out

    def read_into(self, reqs: Iterable[tuple[str, int, list]],
                  done: Callable[[int, int], None] | None = None) -> list[int]:
        """Scatter-read: fill each request's writable buffers, in order, from ``key`` at ``start``
        (one ranged GET per request, all in one concurrent batch, then a copy in the I/O
        threads). ``done(i, n)``: called in the I/O thread once request ``i``'s buffers are
        filled (``n`` bytes), so after every GET of the batch (no overlap with the reads); every
        request is over before this returns or raises the first failure (in request order).
        Returns the bytes read per request (short at end of object; the caller checks)."""
        reqs = list(reqs)
        if not reqs:
            return []
        got = self.read_ranges([(k, s, s + sum(memoryview(b).nbytes for b in bufs)) for k, s, bufs in reqs])

        def one(i: int, req: tuple[str, int, list]) -> int:
            raw, pos = memoryview(got[i]), 0
            for b in req[2]:
                mv = memoryview(b).cast("B")
                n = min(mv.nbytes, len(raw) - pos)
                mv[:n] = raw[pos:pos + n]
                pos += n
            if done is not None:
                done(i, pos)
            return pos

        return run_all(self._pool, one, reqs)

    def exists(self, key: str) -> bool:
        """Does the object ``key`` exist? On S3 one HEAD (s3fs's ``exists`` follows a miss
        with a LIST, to find "directories"; the save protocol polls for objects only)."""
        path = self.path(key)
        if self.s3:
            bucket, obj, _ = self.fs.split_path(path)
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=obj)
                return True
            except FileNotFoundError:
                return False
        self.fs.invalidate_cache(os.path.dirname(path))
        return self.fs.exists(path)

    def size(self, key: str) -> int:
        """The size of object ``key`` in bytes."""
        path = self.path(key)
        self.fs.invalidate_cache(os.path.dirname(path))
        return int(self.fs.info(path)["size"])

    def object_sizes(self, key: str) -> dict[str, int]:
        """Every object under ``key``, at any depth: {key relative to ``key``: size in bytes}."""
        root = self.path(key)
        self.fs.invalidate_cache(root)
        try:
            found = self.fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        prefix = root.rstrip("/") + "/"
        return {p[len(prefix):]: int(info["size"]) for p, info in found.items()
                if p.startswith(prefix) and info.get("type") != "directory"}

    def list_dir(self, key: str = "") -> list[str]:
        """Names (not paths) of the entries directly under ``key``; [] when absent."""
        path = self.path(key)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def rename(self, key: str, new_key: str) -> None:
        """Rename a file or prefix (a copy and a delete on object stores)."""
        self.fs.mv(self.path(key), self.path(new_key), recursive=True)

    def delete_prefix(self, key: str) -> None:
        """Delete the object or every object under ``key``; nothing if there is none."""
        path = self.path(key)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

"""The load's reads (issue 21): each read is checked as soon as it is over, in its I/O thread,
not after every read; a large chunk object is read in several reads (``READ_GROUP_BYTES``
each, so they spread over the I/O threads); a bad inner chunk is
still ``CheckpointCorrupt`` naming it, raised once every read is over. Real local files;
the storage is the real ``LocalStorage`` with its reads logged."""

from __future__ import annotations

import threading

import fsspec
import pytest
import torch

from ckpt_store import CheckpointCorrupt, CheckpointStore, loader
from ckpt_store.loader import load_step
from ckpt_store.storage_local import LocalStorage

D1 = "step-0000000001"


class LoggedStorage(LocalStorage):
    """The real local backend with one I/O thread; logs every read and the thread it ran on."""

    def __init__(self, root: str):
        super().__init__(f"file://{root}", fsspec.filesystem("file"), root, io_threads=1)
        self.events: list[tuple] = []

    def _preadv(self, key, start, bufs):
        n = super()._preadv(key, start, bufs)
        self.events.append(("read", key, start, n, threading.current_thread().name))
        return n


def _saved(tmp_path) -> tuple[str, torch.Tensor]:
    root = str(tmp_path / "ckpt")
    w = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    store = CheckpointStore(f"file://{root}", inner_chunk_bytes=16 * 1024, writer="thread")
    store.save(1, {"model": {"w": w}}, async_=False)     # 16 inner chunks of 4 rows (16 KiB) in one object
    store.close()
    return root, w


def _logged_checks(monkeypatch, st: LoggedStorage) -> None:
    real = loader._Block.check

    def check(blk):
        out = real(blk)
        st.events.append(("check", blk.key, blk.offset, threading.current_thread().name))
        return out
    monkeypatch.setattr(loader._Block, "check", check)


def test_each_read_is_checked_as_soon_as_it_is_over(tmp_path, monkeypatch):
    root, w = _saved(tmp_path)
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 64 * 1024)
    st = LoggedStorage(root)
    _logged_checks(monkeypatch, st)
    target = {"model": {"w": torch.zeros(64, 1024)}}
    stats = load_step(st, D1, target, 0)
    st.close()
    assert torch.equal(target["model"]["w"], w)
    reads = [e for e in st.events if e[0] == "read" and "/c/" in e[1]]
    checks = [e for e in st.events if e[0] == "check"]
    assert len(checks) == 16
    assert len(reads) == 6 and all(e[3] <= 64 * 1024 for e in reads), reads   # 3 + 3 + 3 + 3 + 3 + 1 inner chunks
    assert stats["objects"] == len(reads)
    # one I/O thread: the blocks of a read are checked right after it, before the next read
    first_check = st.events.index(checks[0])
    assert first_check < st.events.index(reads[1]), st.events
    assert {e[-1] for e in checks} == {e[-1] for e in reads} != {threading.current_thread().name}


def test_a_bad_inner_chunk_is_corrupt_naming_it_once_every_read_is_over(tmp_path, monkeypatch):
    root, _w = _saved(tmp_path)
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 64 * 1024)
    path = f"{root}/{D1}/model/w/c/0/0"
    with open(path, "r+b") as fh:      # a byte of inner chunk 1, in the first read
        fh.seek(16 * 1024 + 4 + 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    st = LoggedStorage(root)
    with pytest.raises(CheckpointCorrupt, match=r"model/w/c/0/0.*inner chunk 1 fails its crc32c"):
        load_step(st, D1, {"model": {"w": torch.zeros(64, 1024)}}, 0)
    st.close()
    assert len([e for e in st.events if e[0] == "read" and "/c/" in e[1]]) == 6   # none still running


"""How a rank's part is flushed on a local disk (``flush_mode``): the pure decision, the
directories whose entries must be flushed, and a real ``LocalStorage.make_durable``."""

from __future__ import annotations

import os

import fsspec
import pytest

from ckpt_store.flush_mode import FSYNC_FILES, choose_syncfs, dirs_to_sync
from ckpt_store.storage_local import LocalStorage


@pytest.mark.unit
@pytest.mark.parametrize(("files", "dirty", "have", "want", "reason"), [
    (1, 0, True, False, "per-file flushes cost a few ms"),
    (FSYNC_FILES, None, True, False, "per-file flushes cost a few ms"),
    (FSYNC_FILES + 1, 0, True, True, "one syncfs costs less"),
    (FSYNC_FILES + 1, None, True, True, "one syncfs costs less"),
    (200, 300 << 20, True, False, "syncfs would wait"),          # measured: 146-154 ms against 49-67 ms
    (1000, 300 << 20, True, True, "one syncfs costs less"),      # 280 ms of fsyncs against ~150 ms
    (1000, 1 << 30, True, False, "syncfs would wait"),
    (10, 0, False, False, "no syncfs"),
    (100_000, 0, False, False, "no syncfs"),
])
def test_choose_syncfs(files, dirty, have, want, reason):
    got, why = choose_syncfs(files, dirty, have)
    assert got is want and reason in why, why


@pytest.mark.unit
def test_dirs_to_sync_are_each_files_directory_up_to_the_root_once_deepest_first():
    root = "/s/ckpt"
    paths = [f"{root}/step-1/model/w/c/0/0", f"{root}/step-1/model/w/c/1/0", f"{root}/step-1/parts/rank-00000.json",
             f"{root}/step-1/model/v/c/0"]
    got = dirs_to_sync(root + "/", paths)
    assert got == [f"{root}/step-1/model/w/c/0", f"{root}/step-1/model/w/c/1", f"{root}/step-1/model/v/c",
                   f"{root}/step-1/model/w/c", f"{root}/step-1/model/v", f"{root}/step-1/model/w",
                   f"{root}/step-1/model", f"{root}/step-1/parts", f"{root}/step-1", root]
    assert dirs_to_sync(root, ["/elsewhere/x/y"]) == []


def test_make_durable_flushes_a_small_part_file_by_file_and_a_large_one_as_chosen(tmp_path):
    root = str(tmp_path / "ckpt")
    st = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)
    few = [f"step-1/model/a{i}/c/0" for i in range(3)]
    for key in few:
        st.write(key, [b"x" * 10])
    st.make_durable(few)
    assert st.last_flush is not None and st.last_flush[0] == "fdatasync", st.last_flush
    many = [f"step-1/model/b{i}/c/0" for i in range(FSYNC_FILES + 1)]
    for key in many:
        st.write(key, [b"y" * 10])
    st.make_durable(many)
    assert st.last_flush is not None and st.last_flush[0] in ("syncfs", "fdatasync"), st.last_flush   # by the dirty pages
    with pytest.raises(FileNotFoundError):   # a file that is not there is never reported durable
        st.make_durable(["step-1/model/missing/c/0"])
    st.close()
    assert all(os.path.getsize(os.path.join(root, k)) == 10 for k in few + many)

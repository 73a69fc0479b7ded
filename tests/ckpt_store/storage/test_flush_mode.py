"""How a rank's part is flushed on a local disk (``flush_mode``): the pure decision, the
directories whose entries must be flushed, and a real ``LocalStorage.make_durable``."""

from __future__ import annotations

import errno
import os

import fsspec
import pytest

from ckpt_store.storage import local_disk as storage_local
from ckpt_store.storage.flush_mode import FSYNC_FILES, choose_syncfs, dirs_to_sync
from ckpt_store.storage.local_disk import LocalStorage


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
    # (which files and directories each way flushes: the tests below)
    with pytest.raises(FileNotFoundError):   # a file that is not there is never reported durable
        st.make_durable(["step-1/model/missing/c/0"])
    st.close()
    assert all(os.path.getsize(os.path.join(root, k)) == 10 for k in few + many)


def _recorded_flushes(monkeypatch) -> dict[str, list[str]]:
    """Record every path the storage fdatasyncs or fsyncs (the real calls still run)."""
    seen: dict[str, list[str]] = {"files": [], "dirs": []}
    real_file, real_dir = storage_local._fdatasync, storage_local._fsync_dir

    def fdatasync(path):
        seen["files"].append(path)
        real_file(path)

    def fsync_dir(path):
        seen["dirs"].append(path)
        real_dir(path)
    monkeypatch.setattr(storage_local, "_fdatasync", fdatasync)
    monkeypatch.setattr(storage_local, "_fsync_dir", fsync_dir)
    return seen


def test_a_large_part_flushed_file_by_file_flushes_its_files_their_dirs_and_a_new_roots_parents(tmp_path, monkeypatch):
    """A brand-new root (two levels above it new too) is made durable in its parent: the parent
    of each level the store created is fsynced as the first write creates them, once; the
    part's flush then syncs exactly its files and their directories up to the root."""
    seen = _recorded_flushes(monkeypatch)
    monkeypatch.setattr(storage_local, "choose_syncfs", lambda files, dirty, have: (False, "forced per file"))
    root = str(tmp_path / "new" / "deeper" / "ckpt")
    st = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)
    keys = [f"step-1/model/b{i}/c/0" for i in range(FSYNC_FILES + 1)] + ["step-1/parts/rank-00000.json"]
    for key in keys:
        st.write(key, [b"y" * 10])
    # the parents of the new levels ckpt, deeper and new, deepest first
    assert seen == {"files": [], "dirs": [str(tmp_path / "new" / "deeper"), str(tmp_path / "new"), str(tmp_path)]}
    seen["dirs"].clear()
    st.make_durable(keys)
    paths = [os.path.join(root, k) for k in keys]
    assert st.last_flush == ("fdatasync", "forced per file")
    assert sorted(seen["files"]) == sorted(paths)
    want_dirs = dirs_to_sync(root, paths)
    assert want_dirs[-1] == root and len(want_dirs) == 2 * (len(keys) - 1) + 4   # each b<i>/c and b<i>, model, parts, step-1, root
    assert sorted(seen["dirs"]) == sorted(want_dirs) and len(seen["dirs"]) == len(want_dirs)
    st.close()
    seen["files"].clear()
    seen["dirs"].clear()
    again = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=2)   # the root exists now
    again.write("step-2/x", [b"z"])
    again.make_durable(["step-2/x"])
    again.close()
    assert seen == {"files": [os.path.join(root, "step-2/x")], "dirs": [os.path.join(root, "step-2"), root]}


def test_a_root_made_by_one_storage_is_durable_whichever_storage_flushes_the_part(tmp_path, monkeypatch):
    """Rank 0's storage creates the root (``begin.json``, in the training process) and the
    writer process's own storage flushes the part: the root's entry is flushed at its creation."""
    seen = _recorded_flushes(monkeypatch)
    root = str(tmp_path / "ckpt")
    first = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=1)
    writer = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=1)
    first.write("step-1/.marind/begin.json", [b"{}"])
    writer.write("step-1/model/w/c/0", [b"w"])
    writer.make_durable(["step-1/model/w/c/0"])
    writer.write_json_atomic("step-1/.marind/rank-00000.json", {"rank": 0})
    first.close()
    writer.close()
    assert seen["dirs"] == [str(tmp_path), *[os.path.join(root, d) for d in ("step-1/model/w/c", "step-1/model/w",
                                                                           "step-1/model", "step-1")], root,
                            os.path.join(root, "step-1/.marind")]


@pytest.mark.unit
def test_a_directory_fsync_error_is_raised_unless_the_filesystem_cannot_fsync_directories(tmp_path):
    storage_local._fsync_dir(str(tmp_path))
    storage_local._fsync_dir("/proc")          # procfs: fsync of a directory is EINVAL (not supported): skipped
    with pytest.raises(FileNotFoundError):
        storage_local._fsync_dir(str(tmp_path / "missing"))
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        storage_local._fsync_dir(str(tmp_path / "f"))
    assert storage_local._DIR_FSYNC_UNSUPPORTED == {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
    assert errno.EIO not in storage_local._DIR_FSYNC_UNSUPPORTED


def test_make_durable_raises_when_a_directory_cannot_be_flushed(tmp_path, monkeypatch):
    """A directory of the part that cannot be fsynced (here: renamed away between the file
    flushes and the directory flushes) is a failed flush, never a part reported durable."""
    root = str(tmp_path / "ckpt")
    st = LocalStorage(f"file://{root}", fsspec.filesystem("file"), root, io_threads=1)
    st.write("step-1/a/x", [b"x"])
    real = storage_local._fdatasync

    def fdatasync_then_move(path):
        real(path)
        os.rename(os.path.join(root, "step-1/a"), os.path.join(root, "step-1/b"))
    monkeypatch.setattr(storage_local, "_fdatasync", fdatasync_then_move)
    monkeypatch.setattr(storage_local, "choose_syncfs", lambda files, dirty, have: (False, "forced per file"))
    with pytest.raises(FileNotFoundError):
        st.make_durable(["step-1/a/x"])
    st.close()

"""The read side on damaged checkpoints: every failure is a typed error naming the object
(or the format), and ``load()`` with no step falls back past a corrupt step. Real local
files and a real SeaweedFS server."""

from __future__ import annotations

import json
import warnings

import fsspec
import pytest
import torch

from ckpt_store import CheckpointCorrupt, CheckpointStore
from ckpt_store.errors import CheckpointFormatUnsupported
from ckpt_store.export.single_file import export_safetensors

D2 = "step-0000000002"


def _state(fill: float) -> dict:
    # w: sharded objects (inner chunks of 4 rows, an index at the end); v: one plain chunk
    return {"model": {"w": torch.full((64, 64), fill), "v": torch.full((8,), fill)}, "extra": {"seen": fill}}


def _target() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "v": torch.zeros(8)}, "extra": {}}


def _two_steps(url: str, **opts) -> CheckpointStore:
    store = CheckpointStore(url, inner_chunk_bytes=1024, writer="thread", **opts)
    store.save(1, _state(1.0), async_=False)
    store.save(2, _state(2.0), async_=False)
    return store


def _manifest_path(tmp_path, step: int = 2):
    return tmp_path / "ckpt" / f"step-{step:010d}" / "manifest.json"


def test_a_newer_format_is_refused_everywhere_and_never_quarantined(tmp_path):
    store = _two_steps(f"file://{tmp_path}/ckpt")
    path = _manifest_path(tmp_path)
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": 99}))
    for read in (lambda: store.manifest(2), lambda: store.load(_target(), step=2),
                 lambda: store.load(_target()), lambda: export_safetensors(store, 2, str(tmp_path / "m.st"))):
        with pytest.raises(CheckpointFormatUnsupported, match=r"format 99, newer than this marind reads "
                                                              r"\(2\): upgrade marind"):
            read()
    report = store.verify(2)
    assert not report.ok and "format 99" in report.problems[0]
    assert path.exists(), "a newer marind's step must not be uncommitted by an older one"


@pytest.mark.parametrize("damage", [
    lambda m: [m],
    lambda m: {k: v for k, v in m.items() if k != "format"},
    lambda m: {**m, "format": "1"},
    lambda m: {**m, "objects": {**m["objects"], "model/v/c/0": {"crc32c": 1}}},
    lambda m: {**m, "arrays": {**m["arrays"], "model/v": {"dtype": "float32", "chunks": [8]}}},
    lambda m: {**m, "arrays": {**m["arrays"], "model/v": {**m["arrays"]["model/v"], "dtype": "float5"}}},
    lambda m: {**m, "world": 4},
], ids=["not-an-object", "no-format", "format-not-int", "object-without-size", "array-without-shape",
        "unknown-dtype", "world-not-object"])
def test_a_malformed_manifest_is_corrupt_naming_it_and_load_falls_back(tmp_path, damage):
    store = _two_steps(f"file://{tmp_path}/ckpt")
    path = _manifest_path(tmp_path)
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.raises(CheckpointCorrupt) as err:
        store.load(_target(), step=2)
    assert err.value.object == f"{D2}/manifest.json" and "malformed manifest" in str(err.value)
    with pytest.raises(CheckpointCorrupt):
        store.manifest(2)
    target = _target()
    with pytest.warns(UserWarning, match="skipping checkpoint step 2"):
        store.load(target)
    assert torch.equal(target["model"]["w"], torch.full((64, 64), 1.0)) and target["extra"]["seen"] == 1.0


def _truncate_local(root: str, key: str, keep: int | None) -> None:
    path = f"{root}/{key}"
    if keep is None:
        fsspec.filesystem("file").rm(path)
        return
    with open(path, "r+b") as fh:
        fh.truncate(keep)


def _truncate_s3(fs, root: str, key: str, keep: int | None) -> None:
    path = f"{root}/{key}"
    if keep is None:
        fs.rm(path)
    else:
        fs.pipe_file(path, fs.cat_file(path)[:keep])   # re-PUT shorter bytes


CASES = [("model/w/c/0/0", 10), ("model/v/c/0", 0), ("model/w/c/0/0", None), ("values/rank-00000.json", None)]
IDS = ["sharded-object-cut-to-10-bytes", "chunk-cut-to-0-bytes", "object-deleted", "values-deleted"]


def _check_corrupt_then_fallback(store: CheckpointStore, key: str) -> None:
    with pytest.raises(CheckpointCorrupt) as err:
        store.load(_target(), step=2)
    assert err.value.object == f"{D2}/{key}", str(err.value)
    target = _target()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.load(target)
    assert any(f"skipping checkpoint step 2: checkpoint object '{D2}/{key}'" in str(w.message) for w in caught)
    assert torch.equal(target["model"]["w"], torch.full((64, 64), 1.0))
    assert torch.equal(target["model"]["v"], torch.full((8,), 1.0)) and target["extra"]["seen"] == 1.0


@pytest.mark.parametrize("key,keep", CASES, ids=IDS)
def test_local_truncated_or_missing_object_is_corrupt_naming_it(tmp_path, key, keep):
    store = _two_steps(f"file://{tmp_path}/ckpt")
    _truncate_local(f"{tmp_path}/ckpt/{D2}", key, keep)
    _check_corrupt_then_fallback(store, key)


@pytest.mark.parametrize("key,keep", CASES, ids=IDS)
def test_s3_truncated_or_missing_object_is_corrupt_naming_it(s3, s3_url, key, keep):
    store = _two_steps(s3_url, storage_options=s3.storage_options)
    fs, root = fsspec.core.url_to_fs(s3_url, **s3.storage_options)
    _truncate_s3(fs, f"{root}/{D2}", key, keep)
    _check_corrupt_then_fallback(store, key)


def test_json_values_under_integer_keys_are_filled_in_place(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ckpt", writer="thread")
    store.save(1, {"model": {"w": torch.ones(2)}, "optim": {0: {"step": 5, "lr": 0.1}, 1: {"step": 5}}},
               async_=False)
    inner = {"step": 0}
    target = {"model": {"w": torch.zeros(2)}, "optim": {0: inner, 1: {"step": 0}}}
    store.load(target)
    assert target["optim"] == {0: {"step": 5, "lr": 0.1}, 1: {"step": 5}}
    assert target["optim"][0] is inner


@pytest.mark.parametrize("key", ["model/w/c/0/0", "model/v/c/0"], ids=["sharded-object", "plain-chunk"])
def test_an_object_of_another_save_is_corrupt_though_its_chunks_are_whole(tmp_path, key):
    # step 1's object is whole and self-consistent (every inner crc32c passes), but not step 2's
    store = _two_steps(f"file://{tmp_path}/ckpt")
    root = tmp_path / "ckpt"
    (root / D2 / key).write_bytes((root / "step-0000000001" / key).read_bytes())
    assert store.verify(2).problems == [f"{D2}/{key}: other data than the manifest lists (an object of "
                                        "another save)"]
    _check_corrupt_then_fallback(store, key)

"""Local disks pick a save's write path from what the disk did (``ckpt_store.storage.write_mode``)."""

from __future__ import annotations

import os

import pytest
import torch

from ckpt_store import CheckpointStore
from ckpt_store.storage.write_mode import REPROBE, WriteModes, choose_direct


@pytest.mark.unit
def test_async_saves_always_go_around_the_page_cache():
    assert choose_direct([1e6], [9e9], 5, background=True)[0] is True


@pytest.mark.unit
def test_sync_saves_try_both_paths_then_take_the_faster_and_reprobe():
    assert choose_direct([], [], 0, False) == (True, "first sync save: trying O_DIRECT")
    assert choose_direct([2e8], [], 1, False)[0] is False
    direct, why = choose_direct([2e8, 2.1e8], [2.6e8], 3, False)
    assert direct is False and "260 MB/s buffered" in why
    assert choose_direct([3e8], [2.6e8], 3, False)[0] is True
    assert choose_direct([3e8], [2.6e8], REPROBE, False)[0] is False     # the slower path, once in a while


@pytest.mark.unit
def test_write_modes_keep_the_last_rates_of_sync_saves_only():
    modes = WriteModes()
    modes.record(True, 100, 1.0, background=True)            # an async save's rate says nothing here
    assert modes.sync_saves == 0 and modes.rates[True] == []
    for rate in (1, 2, 3, 4):
        modes.record(True, rate * 100, 1.0, background=False)
    assert modes.rates[True] == [200.0, 300.0, 400.0] and modes.sync_saves == 4


def test_a_local_store_reports_the_path_each_save_took(tmp_path):
    """Through the writer process: direct first, then buffered, async direct; both load back."""
    try:
        probe = tmp_path / "probe"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        os.close(fd)
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): every save takes the page cache there")
    store = CheckpointStore(f"file://{tmp_path / 'ckpt'}")
    state = {"model": {"w": torch.randn(512, 256)}}           # 512 KiB: one O_DIRECT-sized object
    paths = [store.save(1, state, async_=False).timings["direct_io"],
             store.save(2, state, async_=False).timings["direct_io"]]
    pending = store.save(3, state)
    pending.wait(timeout=60)
    paths.append(pending.timings["direct_io"])
    assert paths == [1.0, 0.0, 1.0]
    for step in (1, 2, 3):
        target = {"model": {"w": torch.zeros(512, 256)}}
        store.load(target, step=step)
        assert torch.equal(target["model"]["w"], state["model"]["w"])
    store.close()
    with pytest.raises(ValueError, match="direct_io='yes'"):
        CheckpointStore(f"file://{tmp_path / 'other'}", direct_io="yes")

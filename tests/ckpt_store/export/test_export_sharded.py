"""The sharded safetensors export's pure parts, and its files read by the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ckpt_store.export.sharded import SAFETENSORS_DTYPES, parse_size, plan_shards, safetensors_header


@pytest.mark.unit
@pytest.mark.parametrize("text, n", [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("64MiB", 64 * 2**20),
                                     ("1048576", 1048576), ("1.5kb", 1500), (" 10 B ", 10)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "0", "-1MB", "lots", "5PB"])
def test_parse_size_refuses_non_sizes(text):
    with pytest.raises(ValueError, match="not a positive size"):
        parse_size(text)


@pytest.mark.unit
def test_plan_shards_keeps_order_and_limit():
    assert plan_shards([], 10) == []
    assert plan_shards([4, 4, 4, 20, 1, 9], 10) == [[0, 1], [2], [3], [4, 5]]
    sizes = [3, 7, 1, 1, 8, 2, 2, 2]
    shards = plan_shards(sizes, 8)
    assert [i for s in shards for i in s] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in s) <= 8 for s in shards)


@pytest.mark.unit
def test_header_and_streamed_data_read_back(tmp_path):
    tensors = {"b.w": torch.randn(3, 5), "a.bias": torch.arange(7, dtype=torch.int64),
               "h": torch.randn(2, 2).bfloat16(), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    entries = [(n, SAFETENSORS_DTYPES[t.dtype], list(t.shape), t.numel() * t.element_size())
               for n, t in tensors.items()]
    header = safetensors_header(entries, {"format": "pt"})
    assert (len(header) - 8) % 8 == 0
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    back = load_file(str(path))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_read_values_on_one_rank_of_a_live_group_reads_alone(tmp_path):
    """``read_values`` is a one-process reader (like ``load_arrays``): called on one rank of an
    initialized group it must not wait for the others in a collective (``store.load``
    shares the object lists); it returns rank 0's values."""
    from ckpt_store import CheckpointStore
    from marind.testing.procs import run_torch_workers

    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url)
    store.save(1, {"model": {"w": torch.ones(4)}, "extra": {"model_config": {"n_layer": 2}}}, async_=False)
    store.close()
    results = run_torch_workers("tests.ckpt_store.workers:values_on_one_rank", 2, timeout=90,
                                url=url, flag=str(tmp_path / "read"))
    assert results == [{"read_alone": True}, {"values": {"extra": {"model_config": {"n_layer": 2}}}}], results

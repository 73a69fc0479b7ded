"""Dataset format, `marind data prepare`, and the pure sampling functions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from marind.cli import main as marind_main
from marind.trainer.data.dataset import (
    Sampler,
    TokenDataset,
    num_windows,
    rank_sample_indices,
    read_header,
    sample_window,
    write_dataset,
)
from marind.trainer.schedule import lr_at

pytestmark = pytest.mark.unit  # no process, no server


def test_write_read_roundtrip(tmp_path):
    header = write_dataset(tmp_path / "d", [[1, 2, 3], [4, 5]], vocab_size=256)
    assert (header.documents, header.tokens, header.token_bytes) == (2, 5, 2)
    ds = TokenDataset(tmp_path / "d")
    assert list(ds.tokens) == [1, 2, 3, 4, 5] and list(ds.offsets) == [0, 3, 5]
    big = write_dataset(tmp_path / "b", [[70000]], vocab_size=100000)
    assert big.token_bytes == 4 and int(TokenDataset(tmp_path / "b").tokens[0]) == 70000


def test_missing_or_bad_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="marind data prepare"):
        read_header(tmp_path / "nope")
    (tmp_path / "x.idx").write_bytes(b"garbage" * 20)
    with pytest.raises(ValueError, match="not a marind dataset"):
        read_header(tmp_path / "x")


def test_prepare_text_and_jsonl(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert marind_main(["data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                        "-o", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"output": str(tmp_path / "out"), "documents": 3, "tokens": 8, "vocab_size": 256}
    assert bytes(TokenDataset(tmp_path / "out").tokens.astype(np.uint8)) == b"helloabc"
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert marind_main(["data", "prepare", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "o2")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_prepare_example_is_deterministic(tmp_path):
    for name in ("x", "y"):
        assert marind_main(["data", "prepare", "--example", "--example-docs", "20", "-o", str(tmp_path / name)]) == 0
    assert (tmp_path / "x.bin").read_bytes() == (tmp_path / "y.bin").read_bytes()


def test_sampling_is_a_pure_permutation_per_epoch():
    windows = 50
    epoch0 = [sample_window(3, i, windows) for i in range(windows)]
    assert sorted(epoch0) == list(range(windows))
    assert [sample_window(3, i + windows, windows) for i in range(windows)] != epoch0
    assert sample_window(3, 17, windows) == epoch0[17]


def test_global_batch_is_layout_independent():
    """Every layout covers exactly the same samples of a global batch."""
    position, global_batch, micro = 40, 16, 2
    expected = set(range(position, position + global_batch))
    for dp in (1, 2, 4, 8):
        accum = global_batch // (micro * dp)
        got = [i for r in range(dp) for k in range(accum)
               for i in rank_sample_indices(position, micro_step=k, micro_batch=micro, dp_rank=r, dp_size=dp)]
        assert sorted(got) == sorted(expected) and len(got) == global_batch


def test_sampler_batches(tmp_path):
    write_dataset(tmp_path / "d", [list(range(100))], vocab_size=256)
    s = Sampler(TokenDataset(tmp_path / "d"), seq_len=8, seed=0)
    assert s.windows == num_windows(100, 8) == 12
    x, y = s.batch([0, 1], device=__import__("torch").device("cpu"))
    assert x.shape == (2, 8) and (y[:, :-1] == x[:, 1:]).all()
    with pytest.raises(ValueError, match="seq_len"):
        Sampler(TokenDataset(tmp_path / "d"), seq_len=200, seed=0)


def test_lr_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20)
    assert lr_at(0, **kw) == 0.25 and lr_at(3, **kw) == 1.0
    assert lr_at(4, **kw) == 1.0 and abs(lr_at(20, **kw) - 0.1) < 1e-12
    assert all(lr_at(s, **kw) >= lr_at(s + 1, **kw) for s in range(4, 20))

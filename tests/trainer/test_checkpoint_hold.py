"""A due save skipped on every rank when one rank's lease file holds commits (real gloo ranks).

The ranks agree through the training loop's per-step all-reduce (``Checkpointer.held_here`` /
``agree_held``), not a collective of the save's own: a rank that skipped while another saved
would leave the saver waiting in the save's collectives."""

from __future__ import annotations

import pytest

from marind.testing.procs import run_torch_workers
from marind.trainer import corpus
from marind.trainer.config import load_trainer_spec


def _spec(data: str, ckpt: str) -> dict:
    return load_trainer_spec(f"""
[job]
name = "hold-test"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 1
[train]
steps = 6
seed = 3
[checkpoint]
url = "file://{ckpt}"
every_steps = 2
keep_last = 0
prepare_timeout = "60s"
""", check_worlds=False).to_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 40)
    return str(prefix)


@pytest.mark.parametrize("held_rank,expected", [(None, [2, 4, 6]), (1, [6])])
def test_a_save_held_on_one_rank_is_skipped_on_all(data, tmp_path, held_rank, expected):
    results = run_torch_workers("tests.trainer.workers:train_with_commits_held", 2, timeout=180,
                                spec=_spec(data, str(tmp_path / "ckpt")), run_root=str(tmp_path / "runs"),
                                held_rank=held_rank)
    assert [r["step"] for r in results] == [6, 6]
    # the periodic saves were skipped everywhere; the final save (waited for) is not skipped,
    # and rank 0, whose own lease allows it, commits it
    assert results[0]["steps"] == expected

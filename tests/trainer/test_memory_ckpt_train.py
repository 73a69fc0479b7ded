"""The trainer's memory checkpoints (``[checkpoint] memory_every``): a run stopped after a memory
checkpoint that the durable store never saw restarts from it, resharded into a smaller world, and
the restored model and optimizer equal the saved ones bit for bit; a host without the memory for
them is refused with the figures."""

from __future__ import annotations

import subprocess

import pytest

from marind.testing.procs import WorkersFailed, run_torch_workers
from marind.trainer.data import corpus

SPEC = """
[job]
name = "mem-test"
[data]
path = "{data}"
seq_len = 32
global_batch = 4
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {steps}
[checkpoint]
url = "file://{ckpt}"
every_steps = 4
keep_last = 0
on_stop = false
memory_every = 1
memory_dir = "{mem}"
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 30)
    return str(prefix)


def _spec(data, tmp_path, steps, mem=None) -> dict:
    from marind.trainer.config import TrainerSpec, load_trainer_spec

    path = tmp_path / f"run-{steps}.toml"
    path.write_text(SPEC.format(data=data, ckpt=tmp_path / "ckpt", steps=steps, mem=mem or tmp_path / "mem"))
    spec: TrainerSpec = load_trainer_spec(path)
    return spec.to_dict()


def test_a_stopped_run_restarts_from_its_newest_memory_checkpoint_into_a_smaller_world(data, tmp_path):
    stopped = run_torch_workers("tests.trainer.workers:train_and_digest", 2, timeout=240,
                                env={"MARIND_TEST_STOP_AT_STEP": "6"}, spec=_spec(data, tmp_path, 10))
    assert stopped[0]["stopped"] and stopped[0]["step"] == 6
    assert stopped[0]["last_checkpoint_step"] == 4                # the durable store's newest
    resumed = run_torch_workers("tests.trainer.workers:train_and_digest", 1, timeout=240,
                                spec=_spec(data, tmp_path, 6))[0]
    assert resumed["step"] == 6 and resumed["losses"] == []       # restored step 6: nothing left to train
    assert resumed["data_position"] == stopped[0]["data_position"]
    assert resumed["digests"] == stopped[0]["digests"]             # model and Adam state, bit for bit
    assert not any((tmp_path / "mem").rglob("manifest.json"))      # a run that is done frees the memory


def test_a_host_without_the_memory_is_refused_with_the_figures(data, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        with pytest.raises(WorkersFailed) as failed:
            run_torch_workers("tests.trainer.workers:train_and_digest", 1, timeout=240,
                              spec=_spec(data, tmp_path, 2, mem=small / "m"))
    finally:
        subprocess.run(["umount", str(small)], check=False)
    msg = str(failed.value)
    assert "checkpoint.memory_every = 1 on host" in msg and "needs" in msg and "GiB available" in msg, msg

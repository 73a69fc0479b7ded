"""protect(optimizer): an async save copies the state beside training, and the optimizer's
next step() waits for that copy; anything else that changes the state meanwhile fails the save."""

from __future__ import annotations

import threading

import pytest
import torch

import ckpt_store.save.snapshot as snapshot
from ckpt_store import CheckpointSaveFailed, CheckpointStore


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return model, optim


def _state(model, optim) -> dict:
    return {"model": dict(model.state_dict()),
            "optim": {str(i): s for i, s in enumerate(optim.state.values())}}


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree.detach().clone()


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.fixture
def held_copy(monkeypatch):
    """The snapshot copy starts only once the test lets it (``release.set()``)."""
    release = threading.Event()
    fill = snapshot.fill

    def held(*args, **kwargs):
        assert release.wait(30)
        return fill(*args, **kwargs)
    monkeypatch.setattr(snapshot, "fill", held)
    return release


def test_the_next_optimizer_step_waits_for_the_copy(tmp_path, held_copy):
    model, optim = _model_and_optimizer()
    store = CheckpointStore(f"file://{tmp_path}/c")
    store.protect(optim)
    state = _state(model, optim)
    before = _copy(state)
    pending = store.save(1, state, async_=True)      # returns with the copy not yet made
    model(torch.randn(4, 64)).sum().backward()       # forward and backward may run meanwhile
    stepper = threading.Thread(target=optim.step)
    stepper.start()
    stepper.join(0.5)
    assert stepper.is_alive(), "the optimizer stepped while the snapshot was still to be copied"
    assert _same(_state(model, optim), before)
    held_copy.set()
    stepper.join(30)
    pending.wait(60)
    assert not _same(_state(model, optim), before)   # the step ran, after the copy
    assert pending.timings["step_wait_s"] > 0.3
    target = _copy(before)
    for t in [*target["model"].values(), *[v for s in target["optim"].values() for v in s.values()]]:
        t.zero_()
    store.load(target, step=1)
    assert _same(target, before)


def test_a_change_in_place_during_the_copy_fails_the_save(tmp_path, held_copy):
    model, optim = _model_and_optimizer()
    store = CheckpointStore(f"file://{tmp_path}/c")
    store.protect(optim)
    pending = store.save(1, _state(model, optim), async_=True)
    with torch.no_grad():
        model.weight.mul_(2)                          # not the optimizer: nothing waits for the copy
    held_copy.set()
    with pytest.raises(CheckpointSaveFailed, match="changed in place"):
        pending.wait(60)
    assert store.steps() == []
    store.save(2, _state(model, optim), async_=True).wait(60)   # the next save is not affected
    assert store.steps() == [2]


@pytest.mark.unit
def test_protect_needs_an_optimizer(tmp_path):
    with pytest.raises(TypeError, match="Optimizer"):
        CheckpointStore(f"file://{tmp_path}/c").protect(object())

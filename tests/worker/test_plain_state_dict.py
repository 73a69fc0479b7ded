"""The issue's trap: ``CheckpointStore.load()`` of a plain ``optimizer.state_dict()`` into a fresh Adam.

A fresh Adam has no state until its first step, so its ``state_dict()`` has an empty
``state`` table: the saved moments have nowhere to go. ckpt_store refuses that load with
``CheckpointMismatch`` naming each key, instead of restoring nothing silently; a target that
does not name the table at all (loading only the model) still loads, and so does the same
load once the optimizer has its state slots.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_store import CheckpointMismatch, CheckpointStore
from marind.worker.training_state import init_optimizer_state


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(f"file://{tmp_path / 'ckpt'}")
    yield s
    s.close()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_plain_state_dict_into_fresh_adam_is_refused(store):
    model, opt = _trained()
    store.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}, async_=False).wait()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with pytest.raises(CheckpointMismatch) as err:
        store.load({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()})
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        f"optim/state/{i}/{k}" for i in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert "it would be dropped" in str(err.value)

    store.load({"model": fresh.state_dict()})            # a table the target does not name is not asked for
    assert torch.equal(fresh.weight, model.weight)

    init_optimizer_state(fresh_opt)                      # with its slots, the same load restores everything
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    store.load(target)
    fresh_opt.load_state_dict(target["optim"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])

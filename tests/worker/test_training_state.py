"""``save_training_state`` / ``load_training_state`` in one process against a real file store."""

from __future__ import annotations

import pytest
import torch

import marind.worker as mw
from ckpt_store import CheckpointMismatch
from marind.worker import job_store as ck


@pytest.fixture
def job(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.toml").write_text(f'[job]\nname = "t"\n[checkpoint]\nurl = "{tmp_path / "ckpt"}"\n')
    monkeypatch.setenv("MARIND_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("MARIND_RUN_TOML", raising=False)
    monkeypatch.setattr(ck, "_store", None)
    yield tmp_path
    if ck._store is not None:
        ck._store[2].close()


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x = torch.randn(4, 3, generator=g)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_first_start_loads_nothing_and_touches_nothing(job):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    assert mw.load_training_state(net, opt) is None
    assert len(opt.state) == 0


def test_resume_into_fresh_optimizer_is_exact(job):
    net, ref = _net(), _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.05, betas=(0.8, 0.9))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05, betas=(0.8, 0.9))
    _train(net, opt, range(3))
    mw.save_training_state(3, net, opt, {"pos": 12})
    _train(ref, ref_opt, range(6))               # never interrupted

    net2 = _net(seed=1)                          # other initial weights: all come from the checkpoint
    opt2 = torch.optim.Adam(net2.parameters(), lr=1.0)
    extra: dict = {}
    assert mw.load_training_state(net2, opt2, extra) == 3
    assert extra == {"pos": 12} and opt2.param_groups[0]["lr"] == 0.05 and opt2.param_groups[0]["betas"] == [0.8, 0.9]
    _train(net2, opt2, range(3, 6))
    for a, b in zip(ref.parameters(), net2.parameters()):
        assert torch.equal(a, b)
        for k in ref_opt.state[a]:
            assert torch.equal(ref_opt.state[a][k], opt2.state[b][k])


def test_optimizer_state_with_no_place_to_go_is_an_error(job):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt, range(1))
    mw.save_training_state(1, net, opt)
    target = _net(seed=1)
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(CheckpointMismatch, match=r"optim/0.weight/exp_avg: saved, but the target has no place"):
        mw.load_training_state(target, torch.optim.SGD(target.parameters(), lr=0.1))   # SGD keeps no state
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))       # nothing half-loaded


def test_mismatched_model_names_the_keys(job):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    mw.save_training_state(0, net, opt)
    other = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with pytest.raises(CheckpointMismatch, match=r"model/2.weight: shape \[2, 8\] != saved \[1, 8\]"):
        mw.load_training_state(other, torch.optim.Adam(other.parameters()))


def test_saving_the_held_step_again_is_a_noop(job):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt, range(2))
    mw.save_training_state(2, net, opt)
    mw.save_training_state(2, net, opt)          # periodic save and save-on-stop on one step
    assert ck.checkpoints().steps() == [2]
    assert mw.load_training_state(net, opt) == 2
    mw.save_training_state(2, net, opt)          # stopped right after resuming: nothing to write
    assert ck.checkpoints().steps() == [2]

"""Pure parts of ``marind.worker``: rates, metrics, records, the ``[checkpoint]`` table, state trees."""

from __future__ import annotations

import json

import pytest
import torch

from marind.core.errors import SpecError
from marind.core.progress import ProgressRecord, read_record, record_path
from marind.worker import job_store as ck
from marind.worker import reporting as rep
from marind.worker.training_state import dropped_arrays, init_optimizer_state, state_tree, tensor_names

pytestmark = pytest.mark.unit


def test_tokens_per_s():
    assert rep.tokens_per_s(1000, 2.0) == 500.0
    assert rep.tokens_per_s(None, 2.0) is None
    assert rep.tokens_per_s(1000, 0.0) is None


def test_metrics_must_be_numbers():
    assert rep.check_metrics({"lr": 3e-4, "gn": torch.tensor(0.5), "n": 3}) == {"lr": 3e-4, "gn": 0.5, "n": 3.0}
    for bad in ("x", None, True, torch.ones(2)):
        with pytest.raises(TypeError, match="metrics must be numbers"):
            rep.check_metrics({"m": bad})


def test_reporter_writes_rate_loss_and_metrics(tmp_path):
    now = [100.0]
    r = rep.Reporter(1, 1, 2, tmp_path, clock=lambda: now[0])
    now[0] = 102.0
    r.report(5, loss=torch.tensor(2.5), tokens=4000, metrics={"lr": 0.1})
    doc = json.loads(record_path(tmp_path, 1).read_text())
    assert (doc["step"], doc["loss"], doc["tokens_per_s"], doc["phase"]) == (5, 2.5, 2000.0, "training")
    assert doc["metrics"] == {"lr": 0.1}
    now[0] = 103.0
    r.report(6, loss=float("nan"))          # NaN is no loss; the rate needs tokens; metrics stay
    rec = read_record(record_path(tmp_path, 1))
    assert rec is not None and (rec.step, rec.loss, rec.tokens_per_s, rec.metrics) == (6, None, None, {"lr": 0.1})
    r.mark()
    now[0] = 104.0
    r.report(7, tokens=10)
    assert r.record.tokens_per_s == 10.0


def test_record_metrics_are_optional_and_read_tolerantly():
    old = {"rank": 0, "step": 3, "phase": "training"}
    assert ProgressRecord.from_dict(old).metrics is None
    assert "metrics" not in ProgressRecord.from_dict(old).to_dict()     # old readers see what they saw
    rec = ProgressRecord.from_dict({**old, "metrics": {"lr": 1, "bad": "x", "flag": True}})
    assert rec.metrics == {"lr": 1.0}
    assert ProgressRecord.from_dict({**old, "metrics": [1, 2]}).metrics is None
    assert list(ProgressRecord.from_dict({**old, "metrics": {"a": 1}}).to_dict())[-1] == "metrics"


def test_report_is_a_noop_outside_marind(monkeypatch, tmp_path):
    monkeypatch.delenv("MARIND_RUN_DIR", raising=False)
    monkeypatch.setattr(rep, "_default_pid", 0)
    rep.report(1, loss=1.0, tokens=10, lr=0.1)
    assert rep.default_reporter() is None
    monkeypatch.setenv("MARIND_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(rep, "_default_pid", 0)
    rep.report(1, loss=1.0, lr=0.1)
    rep.finish()
    rec = read_record(record_path(tmp_path, 3))
    assert rec is not None and rec.step == 1 and rec.phase == "done" and rec.metrics == {"lr": 0.1}
    monkeypatch.setattr(rep, "_default_pid", 0)


def test_checkpoint_table_and_url():
    c = ck.checkpoint_spec('[job]\nname = "x"\ncommand = ["python", "t.py"]\n[checkpoint]\nurl = "s3://b/r"\n'
                           'keep_last = 2\n')
    assert (c.url, c.keep_last, c.keep_every) == ("s3://b/r", 2, 0)
    assert ck.checkpoint_spec("[job]\n").url == ""
    with pytest.raises(SpecError, match="unknown key 'checkpoint.keep_lst'.*keep_last"):
        ck.checkpoint_spec("[checkpoint]\nkeep_lst = 2\n")
    with pytest.raises(SpecError, match="fix the syntax"):
        ck.checkpoint_spec("[checkpoint\n")
    assert ck.store_url("s3://b/r") == "s3://b/r"
    assert ck.store_url("ck", ck.Path("/data")) == "file:///data/ck"


def test_run_toml_path():
    assert str(ck.run_toml_path({"MARIND_RUN_TOML": "/a/run.toml", "MARIND_RUN_DIR": "/b"})) == "/a/run.toml"
    assert str(ck.run_toml_path({"MARIND_RUN_DIR": "/b"})) == "/b/run.toml"
    with pytest.raises(ck.NoCheckpoints, match="MARIND_RUN_TOML"):
        ck.run_toml_path({})


def test_checkpoints_without_url_is_one_clear_error(monkeypatch, tmp_path):
    (tmp_path / "run.toml").write_text('[job]\nname = "x"\n')
    monkeypatch.setenv("MARIND_RUN_TOML", str(tmp_path / "run.toml"))
    with pytest.raises(ck.NoCheckpoints, match=r"no \[checkpoint\] url"):
        ck.checkpoints()


def test_dropped_arrays_names_each_key():
    assert dropped_arrays({"model/w", "optim/w/exp_avg"}, {"model/w", "optim/w/exp_avg"}) == []
    problems = dropped_arrays({"model/w", "optim/w/exp_avg", "optim/w/step"}, {"model/w"})
    assert [p.split(":")[0] for p in problems] == ["optim/w/exp_avg", "optim/w/step"]
    assert all("would be dropped" in p for p in problems)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


def test_init_optimizer_state_fills_slots_and_changes_nothing_else():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    got = init_optimizer_state(opt)
    assert len(got) == 4 and all(set(opt.state[p]) >= {"exp_avg", "exp_avg_sq", "step"} for p in got)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters()) and opt.param_groups[0]["lr"] == 0.1
    assert init_optimizer_state(opt) == []                 # nothing fresh any more: untouched


def test_state_tree_names():
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    init_optimizer_state(opt)
    tree = state_tree(net, opt, 7, {"pos": 3, "t": torch.zeros(2)})
    names = set(tensor_names(tree))
    assert "model/0.weight" in names and "optim/1.bias/exp_avg_sq" in names and "extra/user/t" in names
    assert tree["extra"]["step"] == 7 and tree["extra"]["param_groups"][0]["params"][0] == "0.weight"
    json.dumps(tree["extra"]["param_groups"])               # hyperparameters are plain JSON

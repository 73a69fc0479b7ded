"""Rank 0's report history: written by the reporter, tailed across rotation, findings, TensorBoard files."""

from __future__ import annotations

import json
import math

import pytest

from marind.agent.run_history import Finding, Watch, findings, scalars
from marind.agent.tb_events import EventWriter
from marind.agent.wandb_sink import has_api_key, resolve_mode
from marind.core.errors import SpecError
from marind.core.history import HistoryTail, HistoryWriter, history_line, history_path
from marind.core.spec import RunSpec, load_spec, tensorboard_dir
from marind.worker.reporting import Reporter

pytestmark = pytest.mark.unit


def line(step, pid=1, **kw):
    return {"step": step, "pid": pid, "at": 1.0, **kw}


def test_nan_then_rollback_within_a_generation_and_a_restart_is_no_rollback():
    w = Watch()
    got = [f for item in [line(11, loss=1.0), line(12, loss_nonfinite="nan"), line(13, loss_nonfinite="inf"),
                          line(10), line(11, loss=0.9), line(5, pid=2, loss=1.2), line(4, pid=2, loss=1.3)]
           for f in findings(w, item)]
    assert got == [Finding("nonfinite_loss", {"step": 12, "value": "nan"}),
                   Finding("rollback", {"from_step": 13, "to_step": 10, "cause": "non-finite loss at step 12"}),
                   Finding("rollback", {"from_step": 5, "to_step": 4,
                                        "cause": "the program went back to an earlier step"})]


def test_scalars_of_a_line():
    assert scalars(line(3, loss=2.0, tokens_per_s=10.0, metrics={"lr": 1e-3, "loss": 9.0})) == {
        "loss": 2.0, "tokens_per_s": 10.0, "lr": 1e-3}
    assert scalars(line(3, loss_nonfinite="nan")) == {}


def test_reporter_keeps_rank_0s_history_with_non_finite_losses(tmp_path):
    clock = iter(range(100)).__next__
    r0 = Reporter(0, 0, 2, tmp_path, clock=lambda: float(clock()))
    Reporter(1, 1, 2, tmp_path).report(1, loss=1.0)              # rank 1 keeps no history
    r0.report(1, loss=2.5, tokens=64, metrics={"lr": 0.1})
    r0.report(2, loss=float("nan"), tokens=64)
    r0.report(3, loss=float("-inf"))
    rows = [json.loads(x) for x in history_path(tmp_path).read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("at", "pid")} for r in rows] == [
        {"step": 1, "loss": 2.5, "tokens_per_s": 64.0, "metrics": {"lr": 0.1}},
        {"step": 2, "loss_nonfinite": "nan", "tokens_per_s": 64.0},
        {"step": 3, "loss_nonfinite": "-inf"}]
    assert r0.record.loss is None and not (tmp_path / "progress" / "history-rank-1.jsonl").exists()


def test_tail_reads_whole_lines_across_a_rotation(tmp_path):
    path = tmp_path / "h.jsonl"
    w = HistoryWriter(path, rotate_bytes=200)
    tail = HistoryTail(path)
    assert tail.read() == []
    for s in range(1, 4):
        w.append(history_line(s, loss=float(s), tokens_per_s=None, metrics=None, at=1.0, pid=7))
    assert [x["step"] for x in tail.read()] == [1, 2, 3]
    for s in range(4, 9):                         # past 200 bytes: rotated while the tail was not looking
        w.append(history_line(s, loss=float(s), tokens_per_s=None, metrics=None, at=1.0, pid=7))
    assert path.with_name("h.jsonl.1").exists()
    assert [x["step"] for x in tail.read()] == [4, 5, 6, 7, 8]
    with open(path, "a") as fh:
        fh.write('{"step": 9, "pid"')            # half a line: waits for its end
    assert tail.read() == []
    with open(path, "a") as fh:
        fh.write(': 7}\nnot json\n')
    assert [x["step"] for x in tail.read()] == [9]


def test_event_files_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = EventWriter(tmp_path / "tb")
    for step, value in [(1, 3.0), (2, 2.5), (3, math.pi)]:
        w.scalar("loss", value, step, 1000.0 + step)
    w.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.wall_time, e.value) for e in acc.Scalars("loss")] == [
        (1, 1001.0, 3.0), (2, 1002.0, 2.5), (3, 1003.0, pytest.approx(math.pi, rel=1e-6))]


def test_spec_keys_tensorboard_dir_and_wandb(tmp_path):
    spec = load_spec('[job]\ncommand = ["python", "t.py"]\nworking_dir = "/w"\n')
    assert tensorboard_dir(spec, "/r/jobs/j") == "/r/jobs/j/tensorboard" and tensorboard_dir(spec, None) == ""
    spec = load_spec('[job]\ncommand = ["python", "t.py"]\nworking_dir = "/w"\ntensorboard_dir = "tb"\n')
    assert tensorboard_dir(spec, "/r") == "/w/tb"
    old = load_spec('[job]\ncommand = ["python", "t.py"]\nworking_dir = "/w"\n[train]\ntensorboard_dir = "/x/tb"\n')
    assert tensorboard_dir(old, "/r") == "/x/tb"                 # the trainer's older name still works
    spec = load_spec('[job]\nwandb = { project = "p", mode = "offline" }\n')
    assert dict(spec.job.wandb) == {"project": "p", "mode": "offline"}
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).job.wandb == spec.job.wandb   # as stored
    for bad, why in [('{ projct = "p" }', "did you mean 'project'"), ('{ name = "n" }', "needs a project"),
                     ('{ project = "p", mode = "cloud" }', "job.wandb.mode"), ('"p"', "job.wandb must be a table")]:
        with pytest.raises(SpecError, match=why):
            load_spec(f"[job]\nwandb = {bad}\n")


def test_wandb_mode_is_offline_without_a_key(tmp_path):
    assert not has_api_key({"HOME": str(tmp_path)}) and resolve_mode("auto", {"HOME": str(tmp_path)}) == "offline"
    assert resolve_mode("auto", {"HOME": str(tmp_path), "WANDB_API_KEY": "k"}) == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert has_api_key({"HOME": str(tmp_path)}) and resolve_mode("offline", {"HOME": str(tmp_path)}) == "offline"

"""The lighthouse file (marind.core.lighthouse_file): written by the agent, read by the torchft trainer."""

from __future__ import annotations

import json

import pytest

from marind.core.lighthouse_file import LighthouseRecord, lighthouse_path, read_lighthouse, write_lighthouse

pytestmark = pytest.mark.unit


def test_round_trip_and_format(tmp_path):
    path = write_lighthouse(tmp_path, LighthouseRecord("http://h:1", 7, "na"))
    assert path == lighthouse_path(tmp_path) == tmp_path / "ft" / "lighthouse.json"
    assert json.loads(path.read_text()) == {"address": "http://h:1", "epoch": 7, "node": "na"}
    assert list(json.loads(path.read_text())) == ["address", "epoch", "node"]
    assert read_lighthouse(tmp_path) == LighthouseRecord("http://h:1", 7, "na")
    assert not list(path.parent.glob(".*.tmp"))


def test_tolerant_read(tmp_path):
    assert read_lighthouse(tmp_path) is None
    path = lighthouse_path(tmp_path)
    path.parent.mkdir(parents=True)
    for bad in ("{half", "[1]", json.dumps({"epoch": 3}), json.dumps({"address": "a", "epoch": "x"})):
        path.write_text(bad)
        assert read_lighthouse(tmp_path) is None, bad
    path.write_text(json.dumps({"address": "http://h:2"}))
    assert read_lighthouse(tmp_path) == LighthouseRecord("http://h:2", 0, None)


def test_trainer_prefers_the_file_over_the_environment(tmp_path):
    pytest.importorskip("torch")      # marind.trainer.ft.train imports torch
    from marind.trainer.ft.train import LighthouseSource

    src = LighthouseSource(tmp_path, "http://env:9")
    assert src.read() == ("http://env:9", 0)
    write_lighthouse(tmp_path, LighthouseRecord("http://file:1", 4, "na"))
    assert src.read() == ("http://file:1", 4) and src.epoch() == 4
    nowhere = LighthouseSource(None, None)
    assert nowhere.epoch() == -1
    with pytest.raises(RuntimeError, match="needs a lighthouse"):
        nowhere.read()

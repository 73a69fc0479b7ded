"""`marind ckpt ls | inspect | verify | export` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from ckpt_store import CheckpointStore
from tests.support.procs import REPO_ROOT, base_env


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", "ckpt", *args], cwd=REPO_ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=120)


def test_ls_inspect_verify_export(tmp_path, capsys):
    from marind.cli import main

    def _marind(*args: str) -> _Result:
        capsys.readouterr()
        rc = main(["ckpt", *args])
        out = capsys.readouterr()
        return _Result(rc, out.out, out.err)

    url = f"file://{tmp_path}/ckpt"
    empty = _marind("ls", url)
    assert empty.returncode == 0 and "No checkpoints" in empty.stdout
    state = {"model": {"tok.weight": torch.randn(12, 4), "norm": torch.ones(4).bfloat16()},
             "optim": {"tok.weight": {"exp_avg": torch.zeros(12, 4), "step": torch.tensor(3.0)}},
             "extra": {"step": 7}}
    store = CheckpointStore(url)
    store.save(7, state, async_=False)
    store.save(8, state, async_=False)
    out = _marind("ls", url, "--json")
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in json.loads(out.stdout)["steps"]] == [7, 8]
    out = _marind("inspect", url, "--step", "7", "--json")
    arrays = {a["name"]: a for a in json.loads(out.stdout)["arrays"]}
    assert arrays["model/tok.weight"]["shape"] == [12, 4] and arrays["model/norm"]["dtype"] == "bfloat16"
    assert "model/tok.weight" in _marind("inspect", url).stdout
    ok = _marind("verify", url)
    assert ok.returncode == 0 and "step 8: OK" in ok.stdout
    victim = tmp_path / "ckpt" / "step-0000000008" / "model" / "tok.weight" / "c" / "0" / "0"
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(bytes(data))
    bad = _subprocess("verify", url, "--step", "8")  # the real console entry point, once
    assert bad.returncode == 1 and "model/tok.weight/c/0/0" in bad.stdout
    out_file = tmp_path / "model.safetensors"
    exp = _marind("export", url, "--step", "7", "--format", "safetensors", str(out_file))
    assert exp.returncode == 0, exp.stderr
    loaded = load_file(str(out_file))
    assert set(loaded) == {"tok.weight", "norm"}
    assert torch.equal(loaded["tok.weight"], state["model"]["tok.weight"])
    assert torch.equal(loaded["norm"], state["model"]["norm"])
    missing = _marind("inspect", url, "--step", "99")
    assert missing.returncode == 1 and missing.stderr.startswith("Error: ")

"""`marind ckpt ls | inspect | verify | export` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from ckpt_store import CheckpointStore
from marind.testing.procs import REPO_ROOT, base_env


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
    missing = _marind("ls", url)                 # a path that does not exist: exit 1, one line
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
    (tmp_path / "ckpt").mkdir()
    empty = _marind("ls", url)                   # an existing store with no step yet
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


def _run(capsys, *args: str) -> _Result:
    from marind.cli import main

    capsys.readouterr()
    rc = main(["ckpt", *args])
    out = capsys.readouterr()
    return _Result(rc, out.out, out.err)


def _one_error_line(res: _Result) -> str:
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    return lines[0]


def _three_steps_step2_corrupt(tmp_path) -> str:
    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url, writer="thread")
    for step in (1, 2, 3):
        store.save(step, {"model": {"w": torch.full((4, 4), float(step))}}, async_=False)
    (tmp_path / "ckpt" / "step-0000000002" / "manifest.json").write_text("{not json")
    return url


def test_ls_lists_every_step_marking_a_corrupt_manifest_and_exits_1(tmp_path, capsys):
    url = _three_steps_step2_corrupt(tmp_path)
    res = _run(capsys, "ls", url)
    assert res.returncode == 1
    rows = {int(line.split()[0]): line for line in res.stdout.splitlines()[1:]}
    assert sorted(rows) == [1, 2, 3]
    assert "CORRUPT: unreadable manifest" in rows[2] and "CORRUPT" not in rows[1] + rows[3]
    assert "steps [2]" in _one_error_line(res)
    res = _run(capsys, "ls", url, "--json")
    assert res.returncode == 1
    steps = json.loads(res.stdout)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[0]["arrays"] == 1
    assert [bool(s["error"]) for s in steps] == [False, True, False] and steps[1]["error"].startswith("CORRUPT")


def test_verify_without_step_checks_the_newest_step_even_if_its_manifest_is_corrupt(tmp_path, capsys):
    url = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(url, writer="thread")
    for step in (1, 2):
        store.save(step, {"model": {"w": torch.ones(4)}}, async_=False)
    (tmp_path / "ckpt" / "step-0000000002" / "manifest.json").write_text("[]")
    res = _run(capsys, "verify", url)
    assert res.returncode == 1
    assert "step-0000000002/manifest.json" in res.stdout and "step 2: FAILED" in res.stdout


def test_export_refuses_colliding_names_before_writing_anything(tmp_path, capsys):
    url = f"file://{tmp_path}/ckpt"
    CheckpointStore(url, writer="thread").save(
        1, {"model": {"a.b": torch.zeros(2), "a": {"b": torch.ones(3)}}}, async_=False)
    out = tmp_path / "out"
    out.mkdir()
    res = _run(capsys, "export", url, "--step", "1", str(out / "m.safetensors"))
    assert res.returncode == 2
    line = _one_error_line(res)
    assert "'model/a.b'" in line and "'model/a/b'" in line and "'a.b'" in line
    assert list(out.iterdir()) == []
    res = _run(capsys, "export", url, "--step", "1", "--group", "model/a", str(out / "m.safetensors"))
    assert res.returncode == 0 and set(load_file(str(out / "m.safetensors"))) == {"b"}


def test_export_checks_the_output_path_before_reading_the_checkpoint(tmp_path, capsys):
    url = f"file://{tmp_path}/ckpt"
    CheckpointStore(url, writer="thread").save(1, {"model": {"w": torch.ones(4)}}, async_=False)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    for out, says in ((tmp_path / "adir", "is a directory; pass a file name"),
                      (tmp_path / "nodir" / "m.safetensors", "does not exist; create it"),
                      (tmp_path / "afile" / "m.safetensors", "is not a directory; create it")):
        for step in ("1", "99"):   # 99: no such step; the output is refused before the store is read
            res = _run(capsys, "export", url, "--step", step, str(out))
            assert res.returncode == 2 and says in _one_error_line(res), (out, res.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list((tmp_path / "adir").iterdir()) == []


def test_export_removes_its_temp_file_when_the_write_fails(tmp_path):
    from ckpt_store.export.single_file import export_safetensors

    store = CheckpointStore(f"file://{tmp_path}/ckpt", writer="thread")
    store.save(1, {"model": {"w": torch.ones(4), "v": torch.zeros(2)}}, async_=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "m.safetensors"

    def taken_meanwhile(i: int, n: int, nbytes: int) -> None:   # another process takes the name
        if i == n:
            out.mkdir()

    try:
        export_safetensors(store, 1, str(out), progress=taken_meanwhile)
        raise AssertionError("export replaced a directory")
    except IsADirectoryError:
        pass
    assert [p.name for p in out_dir.iterdir()] == ["m.safetensors"] and out.is_dir()


def test_unreachable_s3_endpoint_is_one_line_naming_the_fix(capsys, monkeypatch):
    from marind.core.netutil import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MARIND_S3_ENDPOINT", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # botocore's retries: fail in ~1 s, not ~8
    monkeypatch.delenv("MARIND_DEBUG", raising=False)
    for args in (("ls", "s3://nobucket/ckpt"), ("verify", "s3://nobucket/ckpt", "--step", "1")):
        res = _run(capsys, *args)
        assert res.returncode == 1
        line = _one_error_line(res)
        assert f"cannot reach S3 endpoint {endpoint}" in line and "MARIND_S3_ENDPOINT" in line, line


def test_refused_or_missing_s3_credentials_name_the_fix(s3, s3_url, capsys, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MARIND_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    res = _run(capsys, "ls", s3_url)
    assert res.returncode == 2
    assert "no S3 credentials" in _one_error_line(res) and "AWS_ACCESS_KEY_ID" in res.stderr
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nope")
    res = _run(capsys, "ls", s3_url)
    assert res.returncode == 2
    line = _one_error_line(res)
    assert f"S3 refused access to {s3_url}" in line and "check AWS_ACCESS_KEY_ID" in line


def test_a_mistyped_s3_bucket_is_an_error_not_an_empty_store(s3, capsys, monkeypatch):
    monkeypatch.setenv("MARIND_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.storage_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.storage_options["secret"])
    res = _run(capsys, "ls", "s3://no-such-bucket-here/ckpt")
    assert res.returncode == 2
    line = _one_error_line(res)
    assert "no S3 bucket 'no-such-bucket-here'" in line and "s3://BUCKET/PREFIX" in line, line
    res = _run(capsys, "ls", f"s3://{s3.bucket}/never-saved")   # the bucket is there: just empty
    assert res.returncode == 0 and "No checkpoints" in res.stdout


def test_a_url_that_is_a_file_is_one_line_naming_it(tmp_path, capsys):
    victim = tmp_path / "not-a-store"
    victim.write_text("")
    for args in (("ls", str(victim)), ("verify", f"file://{victim}")):
        res = _run(capsys, *args)
        assert res.returncode == 2
        line = _one_error_line(res)
        assert f"{args[1]} is a file, not a directory" in line and "MARIND_DEBUG" not in line

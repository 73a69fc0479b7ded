"""Teams' own training scripts (tests/worker/scripts/, nothing of the trainer) under a real torchrun.

Each script (plain DDP MLP, FSDP2 stack, Hugging Face GPT-2 from a config) runs twice under
``python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1``: once
without faults, once with rank 1 SIGKILLed after step 5. The second run restarts from its
step-4 checkpoint through ``marind.worker.load_training_state`` and must end with parameters
and optimizer state bit-identical to the first (per-rank sha256 digests the scripts write).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marind.core.progress import read_records
from marind.testing.procs import spawn

SCRIPTS = Path(__file__).parent / "scripts"
STEPS, SAVE_EVERY, KILL_AT = 8, 2, 5


def start_script(tmp: Path, script: str, name: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """Start ``script`` under torchrun with its own run dir and checkpoint store (kept across starts)."""
    base = tmp / name
    (base / "run").mkdir(parents=True, exist_ok=True)
    (base / "run.toml").write_text(f'[job]\nname = "{name}"\n\n[checkpoint]\nurl = "{base / "ckpt"}"\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.5", str(SCRIPTS / script),
           "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--out", str(base / "out")]
    with open(base / "torchrun.log", "ab") as log:
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun's c10d/standalone rendezvous otherwise hands the
        # workers its own TCPStore across restarts without a per-attempt prefix, and restarted gloo
        # ranks read the dead ranks' addresses from it (torch 2.13); a store per attempt avoids that.
        proc = spawn(cmd, env={"MARIND_RUN_DIR": str(base / "run"), "MARIND_RUN_TOML": str(base / "run.toml"),
                               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})},
                     cwd=SCRIPTS, stdout=log, stderr=subprocess.STDOUT)
    return proc, base


def run_script(tmp: Path, script: str, name: str, env: dict | None = None, timeout: float = 400) -> Path:
    """Run ``script`` to its end (exit 0 required); returns its output dir."""
    proc, base = start_script(tmp, script, name, env)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    tail = (base / "torchrun.log").read_text(errors="replace")[-5000:]
    assert rc == 0, f"{script} ({name}) ended with {rc}\n{tail}"
    return base / "out"


def digests(out: Path) -> dict[int, dict]:
    return {r: json.loads((out / f"digest-rank{r}.json").read_text()) for r in range(2)}


def starts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", [pytest.param("mlp_ddp.py", marks=pytest.mark.slow),    # CI: under submit
                                    pytest.param("fsdp2_model.py", marks=pytest.mark.slow),
                                    pytest.param("hf_gpt2.py", marks=pytest.mark.slow)])   # CI's time
def test_killed_worker_resumes_bit_identical(tmp_path, script):
    if script == "hf_gpt2.py":
        pytest.importorskip("transformers")
    clean = run_script(tmp_path, script, "clean")
    faulted = run_script(tmp_path, script, "faulted", env={"WORKER_TEST_KILL_AT_STEP": KILL_AT})

    assert [s["loaded"] for s in starts(clean)] == [None, None]             # a first start loads nothing
    restarted = [s for s in starts(faulted) if s["loaded"] is not None]
    assert (faulted / "killed-once").exists()
    assert sorted(s["loaded"] for s in restarted) == [4, 4]                 # both ranks resumed at step 4
    want, got = digests(clean), digests(faulted)
    assert all(d["step"] == STEPS and d["optim_entries"] > 0 for d in want.values())
    assert got == want      # parameters and optimizer state bit-identical to the fault-free run

    records = read_records(faulted.parent / "run")
    assert sorted(r.rank for r in records) == [0, 1]
    assert all(r.step == STEPS and r.last_checkpoint_step == STEPS and r.tokens_per_s for r in records)


def readme_example() -> str:
    """The ``train.py`` of README's "Run your own training script", as printed there."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("A complete `train.py`:")
    body = text.index("```python\n", start) + len("```python\n")
    return text[body:text.index("```\n", body)]


@pytest.mark.timeout(600)
def test_readme_example_runs_as_written(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    (tmp_path / "run").mkdir()
    (tmp_path / "run.toml").write_text(f'[job]\nname = "mlp"\n\n[checkpoint]\nurl = "{tmp_path / "ckpt"}"\n'
                                       f'keep_last = 2\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = spawn(cmd, env={"MARIND_RUN_DIR": str(tmp_path / "run"), "MARIND_RUN_TOML": str(tmp_path / "run.toml")},
                     cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    assert proc.wait(500) == 0, (tmp_path / "torchrun.log").read_text(errors="replace")[-4000:]
    records = read_records(tmp_path / "run")
    assert [(r.rank, r.step, r.phase, r.last_checkpoint_step) for r in records] == [(0, 1000, "done", 1000),
                                                                                   (1, 1000, "done", 1000)]
    assert records[0].metrics == {"lr": 1e-3} and records[0].loss is not None
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-0000000900", "step-0000001000"]

"""Teams' own scripts submitted to a real agent with ``[job] command = [...]``, one worker SIGKILLed.

The scripts (tests/worker/scripts/: a plain DDP MLP, an FSDP2 stack, a Hugging Face GPT-2
built from a config) import nothing of the trainer. Each runs as ``command = ["python",
SCRIPT, ...]`` from its own ``working_dir`` under ``marind agent``; rank 1 SIGKILLs itself
after step 5. torchrun restarts the workers, they resume from the step-4 checkpoint through
``marind.worker.load_training_state``, the job SUCCEEDs, and the final parameters and
optimizer state are bit-identical to a fault-free run of the same script. CI runs the DDP
script; ``make chaos`` (MARIND_FULL=1) all three.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from marind.cli import main
from marind.testing.procs import REPO_ROOT
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for
from tests.worker.test_own_scripts import KILL_AT, SAVE_EVERY, SCRIPTS, STEPS, digests, run_script, starts


def command_spec(tmp: Path, name: str, command: list[str], env: dict[str, str], *,
                 max_restarts: int = 2, hang_timeout: str = "300s") -> Path:
    """A run.toml that runs ``command`` from the scripts' directory on 2 ranks, with ``env``."""
    env = {"PYTHONPATH": f"{SCRIPTS}{os.pathsep}{REPO_ROOT}", **env}
    env_table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in env.items())
    path = tmp / f"{name}.toml"
    path.write_text(f"""
[job]
name = "{name}"
nproc_per_node = 2
max_restarts = {max_restarts}
hang_timeout = "{hang_timeout}"
command = {json.dumps(command)}
working_dir = "{SCRIPTS}"

[job.env]
{env_table}
[checkpoint]
url = "file://{tmp / 'ckpt'}"
""")
    return path


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", [
    "mlp_ddp.py",
    pytest.param("fsdp2_model.py", marks=pytest.mark.slow),
    pytest.param("hf_gpt2.py", marks=pytest.mark.slow),
])
def test_own_script_under_submit_survives_a_killed_worker_bit_identical(tmp_path, script, etcd, etcd_client,
                                                                       etcd_prefix, capsys, monkeypatch):
    if script == "hf_gpt2.py":
        pytest.importorskip("transformers")
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "state-a"))
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix)
    diag = lambda: agent_log(tmp_path, "a")
    wait_for(lambda: node_registered(etcd_client, "a"), 30, "node a registered", diag=diag)

    out = tmp_path / "out"
    name = "own-" + Path(script).stem.replace("_", "-")
    command = ["python", script, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--out", str(out)]
    assert main(["submit", str(command_spec(tmp_path, name, command, {"WORKER_TEST_KILL_AT_STEP": str(KILL_AT)}))]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]
    wait_for(lambda: job_state(etcd_client, job).get("state") in ("SUCCEEDED", "FAILED"), 600,
             f"{job} finished", interval=0.5, diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    state = job_state(etcd_client, job)
    assert state["state"] == "SUCCEEDED", diag()
    assert state.get("restarts", 0) >= 1

    assert (out / "killed-once").exists()
    restarted = [s for s in starts(out) if s["loaded"] is not None]
    assert sorted(s["loaded"] for s in restarted) == [4, 4]        # both ranks resumed at step 4

    clean = run_script(tmp_path, script, "clean")                 # the same script, never killed
    want = digests(clean)
    assert all(d["step"] == STEPS and d["optim_entries"] > 0 for d in want.values())
    assert digests(out) == want

"""A team's own script that hangs is seen through ``marind.worker.report`` and restarted by a real agent.

``mlp_ddp.py`` (tests/worker/scripts/) runs as a job of a real ``marind agent``
(``command = ["python", "mlp_ddp.py"]``, ``working_dir`` the scripts' directory).
Rank 0 sleeps forever once after step 3: its progress record, written by ``report()``,
stops moving, the agent's hang detection (``hang_timeout = "4s"``) dumps the stacks and
restarts the workers, they resume from the step-2 checkpoint through
``load_training_state``, and the job SUCCEEDs with the same final state as a run that never
hung.

Slow (``make chaos``, for CI's time): CI has hang detection under a real agent in
``tests/agent/test_agent_e2e.py`` and the own-script path through ``report()`` in
``test_submit_own_scripts.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from marind.cli import main
from tests.agent.helpers import agent_log, job_state, node_registered, start_agent, wait_for
from tests.worker.test_own_scripts import digests, run_script, starts
from tests.worker.test_submit_own_scripts import command_spec


def hang_spec(tmp: Path, out: Path) -> Path:
    env = {"WORKER_TEST_HANG_AT_STEP": "3", "WORKER_TEST_STEPS": "8", "WORKER_TEST_SAVE_EVERY": "2",
           "WORKER_TEST_OUT": str(out)}
    return command_spec(tmp, "own-hang", ["python", "mlp_ddp.py"], env, max_restarts=3, hang_timeout="4s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hanging_script_is_detected_through_report_and_restarted(tmp_path, etcd, etcd_client, etcd_prefix,
                                                                 capsys, monkeypatch):
    monkeypatch.setenv("MARIND_ETCD", etcd.endpoint)
    monkeypatch.setenv("MARIND_PREFIX", etcd_prefix)
    monkeypatch.setenv("MARIND_STATE_DIR", str(tmp_path / "state-a"))
    start_agent(tmp_path, "a", etcd.endpoint, etcd_prefix)
    diag = lambda: agent_log(tmp_path, "a")
    wait_for(lambda: node_registered(etcd_client, "a"), 30, "node a registered", diag=diag)

    out = tmp_path / "out"
    assert main(["submit", str(hang_spec(tmp_path, out))]) == 0
    job = capsys.readouterr().out.strip().splitlines()[-1]
    wait_for(lambda: job_state(etcd_client, job).get("state") in ("SUCCEEDED", "FAILED"), 300,
             f"{job} finished", interval=0.5, diag=lambda: f"{job_state(etcd_client, job)}\n{diag()}")
    assert job_state(etcd_client, job)["state"] == "SUCCEEDED", diag()

    events = etcd_client.get_prefix_json(etcd_client.key("jobs", job, "events") + "/").values()
    kinds = [e["kind"] for e in events]
    assert kinds.count("hang_detected") == 1 and "restart" in kinds   # the end (finish()) is no hang
    assert (out / "hung-once").exists()
    assert sorted(s["loaded"] for s in starts(out)[2:]) == [2, 2]   # one restart, from the step-2 checkpoint
    assert len(starts(out)) == 4                                       # and no other

    clean = run_script(tmp_path, "mlp_ddp.py", "clean")      # the same script, never hung
    assert digests(out) == digests(clean)

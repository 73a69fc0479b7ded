"""`make demo`: the product end to end on the embedded defaults.

1. prepares the generated example corpus (``data/example``) if missing;
2. starts one ``marind agent`` with no etcd configured, so it runs its own
   local etcd under ``runs/demo/<time>/agent``;
3. ``marind submit --wait`` the tiny GPT (``examples/tiny.toml`` with absolute
   data and ``file://`` checkpoint paths, one node x 2 processes) and follows
   it to SUCCEEDED;
4. shows ``marind status`` and the committed checkpoints, then stops the
   agent with SIGTERM (it stops its etcd and workers cleanly).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _demo_spec(run_dir: Path, data: Path) -> Path:
    text = (REPO / "examples/tiny.toml").read_text()
    replacements = {
        r'(?m)^nodes = .*$': 'nodes = "1"',
        r'(?m)^path = .*$': f'path = "{data.resolve()}"',
        r'(?m)^url = .*$': f'url = "file://{(run_dir / "ckpt").resolve()}"',
    }
    for pattern, value in replacements.items():
        text, count = re.subn(pattern, value, text, count=1)
        if count != 1:
            raise RuntimeError(f"examples/tiny.toml has no line matching {pattern!r}")
    path = run_dir / "run.toml"
    path.write_text(text)
    return path


def _marind(*args: str, env: dict) -> int:
    return subprocess.call([sys.executable, "-m", "marind", *args], env=env)


def _wait_endpoint(state: Path, agent: subprocess.Popen, timeout: float = 60.0) -> str:
    endpoint_file = state / "etcd.endpoint"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise RuntimeError(f"marind agent exited with {agent.returncode}; see {state.parent / 'agent.log'}")
        if endpoint_file.exists() and endpoint_file.read_text().strip():
            return endpoint_file.read_text().strip()
        time.sleep(0.2)
    raise RuntimeError(f"the agent's embedded etcd did not come up in {timeout:.0f}s")


def _stop(agent: subprocess.Popen, timeout: float = 60.0) -> None:
    if agent.poll() is not None:
        return
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)


def main() -> int:
    from marind.commands.data import prepare

    os.chdir(REPO)
    data = Path("data/example")
    if not Path(f"{data}.idx").exists():
        header = prepare([], str(data), example=True)
        print(f"prepared the example corpus: {data}.bin ({header.tokens} tokens)")
    run_dir = (Path("runs/demo") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    state = run_dir / "agent"
    state.mkdir(parents=True)
    spec = _demo_spec(run_dir, data)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("MARIND_ETCD", None)
    agent_log = open(run_dir / "agent.log", "wb")
    print(f"starting marind agent (embedded etcd, state dir {state}; log {run_dir / 'agent.log'})")
    agent = subprocess.Popen([sys.executable, "-m", "marind", "agent", "--node", "demo",
                              "--state-dir", str(state), "--metrics-port", "-1"],
                             env={**env, "MARIND_LOG_JSON": "1"}, stdout=agent_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    agent_log.close()
    try:
        endpoint = _wait_endpoint(state, agent)
        env["MARIND_ETCD"] = endpoint
        print(f"etcd at {endpoint}\n$ marind submit {spec} --wait")
        rc = _marind("submit", str(spec), "--wait", env=env)
        print("$ marind status")
        _marind("status", env=env)
        if rc != 0:
            print(f"demo failed: the job did not succeed (exit {rc}); see {run_dir}", file=sys.stderr)
            return 1
        from ckpt_store import CheckpointStore
        url = f"file://{run_dir / 'ckpt'}"
        print(f"checkpoints (Zarr v3): {url}  committed steps {CheckpointStore(url).steps()}")
        print(f"inspect one: marind ckpt inspect {url}")
        return 0
    finally:
        _stop(agent)


if __name__ == "__main__":
    sys.exit(main())

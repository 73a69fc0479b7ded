"""`make demo`: train the tiny GPT on the generated example corpus with 2 processes.

Prepares ``data/example`` if missing, runs ``torchrun --standalone
--nproc-per-node 2 -m trainer`` on ``examples/tiny.toml`` with a fresh
checkpoint directory under ``runs/demo/``, prints a line every few
steps, then where the checkpoints went and the final loss. (It runs the
trainer directly; once the daemon is up this goes through ``marind agent``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    from marind.commands.data import prepare
    from marind.spec import load_spec

    os.chdir(REPO)
    data = Path("data/example")
    if not Path(f"{data}.idx").exists():
        header = prepare([], str(data), example=True)
        print(f"prepared the example corpus: {data}.bin ({header.tokens} tokens, {header.documents} documents)")
    run_dir = Path("runs/demo") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec("examples/tiny.toml").to_dict()
    spec["checkpoint"]["url"] = "file://" + str((run_dir / "ckpt").resolve())
    spec["data"]["path"] = str(data.resolve())
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    log_path = run_dir / "train.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainer", str(spec_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MARIND_LOG_JSON": "1", "MARIND_RUN_DIR": str(run_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"training {spec['model']['preset']} for {spec['train']['steps']} steps on 2 processes "
          f"(log: {log_path})")
    last = None
    t0 = time.monotonic()
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            event = _event(line)
            if event.get("event") == "step":
                last = event
                if event["step"] % 20 == 0 or event["step"] == 1:
                    print(f"  step {event['step']:4d}  loss {event['loss']:.4f}  "
                          f"{event['tokens_per_s']:8.0f} tokens/s  grad_norm {event['grad_norm']:.3f}")
            elif event.get("event") in ("restored", "train_failed"):
                print(f"  {event['event']}: {event}")
        rc = proc.wait()
    if rc != 0:
        print(f"demo failed: trainer exited with {rc}; see {log_path}", file=sys.stderr)
        return 1
    from ckpt_store import CheckpointStore
    store = CheckpointStore(spec["checkpoint"]["url"])
    print(f"done in {time.monotonic() - t0:.0f}s: final loss {last['loss']:.4f} at step {last['step']}")
    print(f"checkpoints (Zarr v3): {spec['checkpoint']['url']}  committed steps {store.steps()}")
    print(f"inspect one: marind ckpt inspect {spec['checkpoint']['url']}")
    return 0


def _event(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


if __name__ == "__main__":
    sys.exit(main())

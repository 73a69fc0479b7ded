"""A tiny job entrypoint for agent tests: `python -m tests.agent.tiny_worker run.toml`.

Joins the process group (gloo on CPU), "trains" ``train.steps`` steps (an
all-reduce and a short sleep each), writes the progress record of the
agent contract after every step, and "checkpoints" the step number to
``checkpoint.url`` (a file:// dir) so that a restarted job resumes where
it left off. Rank 0 writes ``done.json`` there at the end. With
``MARIND_TEST_PRINT_STEPS=1`` each rank prints a line (1 KB) per step (into torchrun's log); with
``MARIND_TEST_LAST_STEP_GATE=FILE`` the last step waits until FILE exists.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist

from marind.core.disk import is_disk_full
from marind.core.jsonfile import write_json_atomic
from marind.distributed import init_distributed, shutdown_distributed


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = tomllib.loads(Path(argv[0]).read_text())
    steps = int(spec["train"]["steps"])
    ckpt = Path(spec.get("checkpoint", {}).get("url", "file:///tmp/marind-tiny").removeprefix("file://"))
    ckpt.mkdir(parents=True, exist_ok=True)
    sleep_s = float(os.environ.get("MARIND_TEST_STEP_SLEEP", "0.2"))
    hang_at = int(os.environ.get("MARIND_TEST_HANG_AT_STEP", "0"))
    chatty = os.environ.get("MARIND_TEST_PRINT_STEPS") == "1"      # a line on stdout per step
    gate = os.environ.get("MARIND_TEST_LAST_STEP_GATE")            # the last step waits for this file
    device = init_distributed(timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    run_dir = os.environ.get("MARIND_RUN_DIR")
    record_path = Path(run_dir) / "progress" / f"rank-{rank}.json" if run_dir else None
    if record_path:
        record_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "local_rank": local_rank, "world_size": world, "pid": os.getpid(), "step": 0,
              "loss": None, "tokens_per_s": None, "last_checkpoint_step": None, "phase": "restoring",
              "updated_at": time.time()}

    def report(**fields):
        record.update(fields, updated_at=time.time())
        if record_path:
            try:
                write_json_atomic(record_path, record)   # a full disk does not stop it
            except OSError as exc:    # as marind.core.progress.ProgressWriter: a full disk skips one write
                if not is_disk_full(exc):
                    raise

    report()
    step_file = ckpt / "step"
    start = int(step_file.read_text()) if step_file.exists() else 0
    t = torch.tensor([float(start)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)   # every rank agrees on where to resume
    step = int(t.item())
    report(phase="training", step=step, last_checkpoint_step=step)
    tic = time.monotonic()
    while step < steps:
        if hang_at and step == hang_at and rank == 0 and not (ckpt / "hung-once").exists():
            (ckpt / "hung-once").write_text("1")
            time.sleep(3600)
        while gate and step == steps - 1 and not Path(gate).exists():
            time.sleep(0.1)
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        time.sleep(sleep_s)
        step += 1
        if rank == 0:
            step_file.write_text(str(step))
        tps = 1000.0 * world / max(1e-6, (time.monotonic() - tic) / max(1, step - start))
        report(step=step, loss=1.0 / step, tokens_per_s=tps, last_checkpoint_step=step)
        if chatty:
            print(f"rank {rank} step {step} " + "." * 1000, flush=True)
    report(phase="done")
    if rank == 0:
        write_json_atomic(ckpt / "done.json", {"step": step, "world_size": world, "resumed_from": start})
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A tiny torchrun worker for the rendezvous tests.

``python rank_worker.py OUTDIR``: records what torchrun gave it
(``OUTDIR/a{agent_pid}-r{restart}-p{pid}.json``), joins the gloo group
and all-reduces every 0.1 s. It finishes (exit 0) once ``OUTDIR/finish``
holds its world size and it has done a few all-reduces in that world;
a dead peer makes the all-reduce fail (exit 1, so torchrun restarts the
group); past ``RDZV_TEST_DEADLINE_S`` (default 90) it gives up (exit 3).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from marind.distributed import init_distributed, shutdown_distributed


def main(outdir: Path) -> int:
    env = {k: os.environ.get(k) for k in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    record = {**env, "pid": os.getpid(), "agent_pid": os.getppid(), "at": time.time()}
    name = f"a{os.getppid()}-r{env['TORCHELASTIC_RESTART_COUNT']}-p{os.getpid()}.json"
    (outdir / name).write_text(json.dumps(record))
    device = init_distributed(timeout_s=20)
    deadline = time.monotonic() + float(os.environ.get("RDZV_TEST_DEADLINE_S", "90"))
    agreed = 0
    while time.monotonic() < deadline:
        finish = outdir / "finish"
        ready = finish.exists() and finish.read_text().strip() == str(world)
        # one all-reduce carries both the check and the vote, so all ranks stop together
        values = torch.tensor([rank + 1, int(ready)], device=device)
        dist.all_reduce(values)
        if int(values[0].item()) != world * (world + 1) // 2:
            raise SystemExit(f"all_reduce gave {int(values[0].item())} in a world of {world}")
        agreed = agreed + 1 if int(values[1].item()) == world else 0
        if agreed >= 3:
            shutdown_distributed()
            (outdir / f"done-w{rank}").write_text(str(world))
            return 0
        time.sleep(0.1)
    return 3


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

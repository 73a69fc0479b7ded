"""A team's DDP script that fails the ways training guides list first, once each, then finishes.

Run under marind (``[job] command = ["python", "faulty_mlp.py", ...]``, 2 ranks, gloo, CPU)::

    --steps N        train to step N, a checkpoint every --save-every steps
    --nan-at S       first round only: the loss of step S is NaN on every rank; the script then
                     rolls back to its latest checkpoint (as a trainer guarding its loss does)
    --oom-at S       rank 1, once: moves itself into the memory cgroup --cgroup (a directory of
                     the v1/v2 memory controller with a limit), waits --oom-wait seconds (its
                     agent sees it there), then allocates until the kernel's OOM killer ends it;
                     without --cgroup it SIGKILLs itself instead
    --kill-at S      rank 1, once: SIGKILLs itself
    --hang-at S      rank 1, once: stops answering (sleeps) before the step's collective; rank 0's
                     gloo collective times out after $FAULTY_TIMEOUT_S seconds (default 8)

"Once" is a marker file in --out. Imports nothing of marind but ``marind.worker``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import marind.worker as mw

BATCH = 16


def once(out: Path, name: str) -> bool:
    """True the first time ``name`` is asked for (a marker file in ``out``)."""
    marker = out / f"{name}.once"
    if marker.exists():
        return False
    marker.write_text(str(os.getpid()))
    return True


def run_out_of_memory(cgroup: str | None, wait_s: float) -> None:
    """Move into ``cgroup`` and allocate past its limit (the OOM killer ends this process); SIGKILL without one."""
    if cgroup:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
        time.sleep(wait_s)
        blocks = []
        while True:
            blocks.append(torch.ones(16 << 20))        # 64 MiB, every page touched
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("steps", "save-every", "nan-at", "oom-at", "kill-at", "hang-at"):
        p.add_argument(f"--{name}", type=int, default=0)
    p.add_argument("--cgroup", default="")
    p.add_argument("--oom-wait", type=float, default=2.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("FAULTY_TIMEOUT_S", 8))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra: dict = {}
    loaded = mw.load_training_state(model, opt, extra)
    step, first_round = loaded or 0, loaded is None
    while step < args.steps:
        if rank == 1 and step + 1 == args.oom_at and once(out, "oom"):
            run_out_of_memory(args.cgroup, args.oom_wait)
        if rank == 1 and step + 1 == args.kill_at and once(out, "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and step + 1 == args.hang_at and once(out, "hang"):
            time.sleep(3600)                            # stops answering; torchrun ends it
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(BATCH, 8, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if first_round and step == args.nan_at:
            first_round = False
            mw.report(step, loss=float("nan"), tokens=BATCH * world)
            step = mw.load_training_state(model, opt, extra) or 0     # roll back to the latest checkpoint
            mw.report(step)
            continue
        mw.report(step, loss=loss, tokens=BATCH * world, lr=opt.param_groups[0]["lr"])
        if step % args.save_every == 0 or step == args.steps:
            mw.save_training_state(step, model, opt, extra)
    mw.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

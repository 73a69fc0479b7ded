"""A team's plain DDP script: an MLP regression with AdamW, resumable through ``marind.worker``.

Run: ``torchrun --nproc-per-node=2 mlp_ddp.py --steps 8 --out DIR`` (gloo, CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scripthooks import after_step, note_start, parse_args, write_digest
from torch.nn.parallel import DistributedDataParallel as DDP

import marind.worker as mw

BATCH = 16


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    mw.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    extra = {"samples": 0}
    loaded = mw.load_training_state(model, opt, extra)
    note_start(args.out, rank, loaded)
    step = loaded or 0
    while step < args.steps:
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        extra["samples"] += BATCH * world
        mw.report(step, loss=loss, tokens=BATCH * world, lr=opt.param_groups[0]["lr"])
        if step % args.save_every == 0 or step == args.steps:
            mw.save_training_state(step, model, opt, extra)
        if mw.should_stop():
            mw.save_training_state(step, model, opt, extra)
            break
        after_step(args.out, rank, step)
    mw.finish()
    write_digest(args.out, rank, step, model, opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

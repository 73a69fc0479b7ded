"""A team's FSDP2 script: a small residual MLP stack sharded with ``fully_shard``, Adam, resumable.

Run: ``torchrun --nproc-per-node=2 fsdp2_model.py --steps 8 --out DIR`` (gloo, CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from scripthooks import after_step, note_start, parse_args, write_digest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import marind.worker as mw

BATCH, DIM = 8, 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    mw.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loaded = mw.load_training_state(model, opt)
    note_start(args.out, rank, loaded)
    step = loaded or 0
    while step < args.steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(BATCH, DIM, generator=g)
        loss = (model(x) - x.mean(1, keepdim=True).cos()).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        mw.report(step, loss=loss, tokens=BATCH * world)
        if step % args.save_every == 0 or step == args.steps:
            mw.save_training_state(step, model, opt)
        if mw.should_stop():
            mw.save_training_state(step, model, opt)
            break
        after_step(args.out, rank, step)
    mw.finish()
    write_digest(args.out, rank, step, model, opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

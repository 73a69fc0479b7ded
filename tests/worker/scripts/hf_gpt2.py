"""A team's Hugging Face script: a tiny GPT-2 built from a config (no download), DDP, AdamW, resumable.

Run: ``torchrun --nproc-per-node=2 hf_gpt2.py --steps 8 --out DIR`` (gloo, CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from scripthooks import after_step, note_start, parse_args, write_digest
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

import marind.worker as mw

BATCH, SEQ, VOCAB = 4, 16, 64


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    mw.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = DDP(GPT2LMHeadModel(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaded = mw.load_training_state(model, opt)
    note_start(args.out, rank, loaded)
    step = loaded or 0
    while step < args.steps:
        g = torch.Generator().manual_seed(104729 * step + rank)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        mw.report(step, loss=loss, tokens=BATCH * SEQ * world)
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

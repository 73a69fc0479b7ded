"""The small API a training program uses under marind: progress, stop, checkpoints.

Any program torchrun can run works under marind; this API is what makes marind see it:

* :func:`report` (``step, loss=None, tokens=None, **metrics``): this rank's progress record,
  read by the agent's hang detection, ``marind status`` and the per-job metrics. Call it
  after every optimizer step. A no-op outside marind.
* :func:`finish`: this rank is done training (phase ``done``): what follows (evaluation,
  teardown) is not taken for a hang.
* :func:`should_stop`: True once SIGTERM/SIGINT (a cancel, a drain, a resize) reached any
  rank, agreed across ranks (collective: every rank calls it at the same points).
  :func:`install` arms the handler early (otherwise the first call does).
* :func:`checkpoints`: the job's ``ckpt_store.CheckpointStore`` (``[checkpoint]`` of its spec).
* :func:`save_training_state` / :func:`load_training_state`: model, optimizer (full state,
  by parameter FQN) and your own ``extra``, for plain modules, DDP and FSDP2 with any
  torch optimizer; load returns the step it loaded, None on a first start.

A complete program (``train.py``, run with ``[job] command = ["python", "train.py"]``)::

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import marind.worker as mw


    def main():
        dist.init_process_group("gloo")          # "nccl" on GPUs; torchrun set RANK, WORLD_SIZE, MASTER_ADDR
        mw.install()                             # SIGTERM from now on means "stop at the next step"
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        extra = {"data_position": 0}
        step = mw.load_training_state(model, opt, extra) or 0    # None on a first start
        while step < 1000:
            g = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            extra["data_position"] += 32 * world
            mw.report(step, loss=loss.item(), tokens=32 * world, lr=1e-3)
            if step % 100 == 0:
                mw.save_training_state(step, model, opt, extra)
            if mw.should_stop():                 # every rank, every step, same place
                mw.save_training_state(step, model, opt, extra)
                break
        mw.finish()
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()

and its ``run.toml``::

    [job]
    name = "mlp"
    command = ["python", "train.py"]
    nproc_per_node = 2

    [checkpoint]
    url = "s3://bucket/mlp"

The environment each rank gets is listed in ``marind.core.workerenv`` (``MARIND_RUN_DIR``,
``MARIND_RUN_TOML``, ``MARIND_JOB_ID``, ...) besides torchrun's ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

from marind.worker.job_store import NoCheckpoints, checkpoints
from marind.worker.reporting import finish, report, set_phase
from marind.worker.stop import install, should_stop
from marind.worker.training_state import load_training_state, save_training_state

__all__ = ["NoCheckpoints", "checkpoints", "finish", "install", "load_training_state", "report", "save_training_state",
           "set_phase", "should_stop"]

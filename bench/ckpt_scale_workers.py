"""The rank side of ``bench/ckpt_scale.py``: one world saving and loading many small arrays.

``worker`` builds ``arrays`` arrays of ``rows`` x ``cols`` float32 (``rows`` a multiple of
the world size), each a DTensor
sharded along dim 0 over every rank (FSDP's layout: an array has an object per rank
once it is not gathered), saves them with marind (sync: the save includes the
commit) and with DCP, ``repeats`` times each after one untimed save, loads each
back into fresh tensors, and times how long an async save of each holds the caller
(marind's ``save(async_=True)``; DCP's thread-based ``async_save`` on its own gloo group);
it returns the medians on rank 0 (``{}`` elsewhere), as
``marind.testing.procs.run_torch_workers`` expects.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

from bench.ckpt_rank_ops import dcp_group, timed


def _state(arrays: int, rows: int, cols: int, fill: bool):
    """``arrays`` DTensors of ``rows`` x ``cols``, sharded along dim 0 over every rank, each
    built from this rank's rows (no collective per array: 10,000 of them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mine = rows // world
    out = {}
    for i in range(arrays):
        local = torch.full((mine, cols), float(i)) if fill else torch.zeros(mine, cols)
        out[f"w{i:06d}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size((mine * world, cols)), stride=(cols, 1))
    return {"model": out}


def _clear(path: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()
    dist.barrier()


def _blocked(save) -> float:
    """How long ``save()`` held the caller, the longest over the ranks (a training step waits for
    the slowest); ``save`` returns something with ``result()`` or ``wait()``, waited for after."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    pending = save()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    (pending.result if hasattr(pending, "result") else pending.wait)()
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took[0])


def worker(root: str, arrays: int, rows: int, cols: int, repeats: int, store_kwargs: dict | None = None) -> dict:
    """Time marind's and DCP's save and load of ``arrays`` sharded arrays in this world.

    Returns (rank 0): ``marind_save_s``, ``marind_commit_s`` (rank 0: from the end of its
    own part to the manifest), ``marind_load_s``, ``dcp_save_s``, ``dcp_load_s``,
    ``marind_blocked_s``, ``dcp_blocked_s`` (an async save's hold on the caller) (medians),
    ``objects`` (marind's objects in a step) and ``every`` (each timed figure).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt_store import CheckpointStore

    torch.set_num_threads(1)
    state = _state(arrays, rows, cols, fill=True)
    store = CheckpointStore(f"file://{root}/marind", keep_last=1, **(store_kwargs or {}))
    got: dict[str, list[float]] = {k: [] for k in ("marind_save_s", "marind_commit_s", "marind_load_s",
                                                   "dcp_save_s", "dcp_load_s", "marind_blocked_s",
                                                   "dcp_blocked_s")}
    try:
        for i in range(repeats + 1):               # i = 0: untimed (starts the writer, warms the caches)
            step = 2 * i                           # sync saves; 2 * i + 1: the async ones
            done: list = []
            took = timed(lambda step=step, done=done: done.append(store.save(step, state, async_=False)))
            _clear(f"{root}/dcp")
            dcp_took = timed(lambda: dcp.save(state, checkpoint_id=f"{root}/dcp"))
            if i:
                t = done[0].timings
                got["marind_save_s"].append(took)
                got["marind_commit_s"].append(t.get("commit_s", 0.0) - t.get("write_s", 0.0))
                got["dcp_save_s"].append(dcp_took)
            target = _state(arrays, rows, cols, fill=False)
            got["marind_load_s"].append(timed(lambda target=target, step=step: store.load(target, step=step)))
            target = _state(arrays, rows, cols, fill=False)
            got["dcp_load_s"].append(timed(lambda target=target: dcp.load(target, checkpoint_id=f"{root}/dcp")))
            if i == repeats:
                objects = len(store.manifest(step)["objects"])
            got["marind_blocked_s"].append(_blocked(lambda step=step: store.save(step + 1, state, async_=True)))
            _clear(f"{root}/dcp-async")
            got["dcp_blocked_s"].append(_blocked(lambda: dcp.async_save(state, checkpoint_id=f"{root}/dcp-async",
                                                                        process_group=dcp_group())))
            if not i:
                for k in ("marind_load_s", "dcp_load_s", "marind_blocked_s", "dcp_blocked_s"):
                    got[k].clear()
        assert torch.equal(target["model"][f"w{arrays - 1:06d}"].to_local(),
                           torch.full_like(target["model"][f"w{arrays - 1:06d}"].to_local(), float(arrays - 1)))
    finally:
        store.close()
    if dist.get_rank() != 0:
        return {}
    out: dict = {k: statistics.median(v) for k, v in got.items()}
    out.update(world=dist.get_world_size(), arrays=arrays, objects=objects,
               every={k: [round(x, 4) for x in v] for k, v in got.items()}, at=time.time())
    return out

"""The checkpoint benchmark's rank side (bench/ckpt_bench.py): what each of its 4 (then 2) ranks runs.

``worker`` times marind and DCP against a local dir, the bench's slow disk
(``marind/testing/slow_disk.py``) and an S3 prefix (``bench_target``: saves sync and
async, in turns, DCP's async both thread-based and process-based
(``bench/ckpt_dcp_process.py``), then loads) and
torch.save of the gathered state; ``reshard_worker`` loads the 4-rank
checkpoints on 2 ranks. Both return their figures on rank 0 (``{}``
elsewhere), as ``marind.testing.procs.run_torch_workers`` expects.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from bench.ckpt_dcp_process import DcpProcessSaver
from bench.ckpt_rank_ops import (
    build_model,
    cpu_seconds,
    dcp_checkpoint_id,
    dcp_group,
    dcp_reader,
    dcp_writer,
    load_fields,
    remove_on_rank0,
    state_of,
    steps_while,
    tensors,
    timed,
    timed_loads,
    train_step,
)

QUIET_STEPS = 2   # steps without a save right before each async save: the slowdown's baseline
PHASE_KEYS = ("prepare_s", "blocked_s", "write_s", "commit_s")


@dataclass
class Target:
    """One target (a local dir or an S3 prefix) under test, and what its saves recorded.

    ``store`` is the CheckpointStore timed; ``pruner`` (``keep_last=1``) deletes old
    steps between the timed saves, as DCP's are deleted (``remove_on_rank0``).
    """

    url: str
    opts: dict | None
    model: Any
    optim: Any
    dim: int
    store: Any
    pruner: Any
    server_pid: int | None = None
    step: int = 0
    dcp_saves: int = 0
    dcp_checkpoint_id: str | None = None
    pruned: list[float] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)
    writer_cpu: list[float] = field(default_factory=list)
    dcp_proc: Any = None        # DcpProcessSaver, made by the first process-based save

    @property
    def local(self) -> bool:
        return not self.url.startswith("s3://")

    @property
    def dcp_path(self) -> str:
        return f"{self.url}/dcp"


class AsyncSave(NamedTuple):
    """The figures of one async save."""

    blocked: float              # the save call, plus an optimizer step's wait for the copy
    commit: float               # from the save call until it completed (rank 0's view)
    during: list[float]         # step times while the save ran
    quiet: list[float]          # step times just before it
    server: float | None        # the S3 server's CPU seconds meanwhile (None: no server pid)


def open_target(url: str, opts, model, optim, dim: int, store_kwargs: dict | None,
                server_pid: int | None) -> Target:
    from ckpt_store import CheckpointStore

    local = not url.startswith("s3://")
    mk_url = f"{url}/marind" if not local else f"file://{url}/marind"
    store = CheckpointStore(mk_url, storage_options=opts, **(store_kwargs or {}))
    store.protect(optim)   # async snapshots are copied beside forward/backward; optim.step() waits for them
    # old steps are deleted between the timed saves, as DCP's are (remove_on_rank0): back-to-back saves
    # would otherwise time the previous step's deletes (queued behind its commit) inside the next save
    pruner = CheckpointStore(mk_url, storage_options=opts, keep_last=1)
    return Target(url=url, opts=opts, model=model, optim=optim, dim=dim, store=store, pruner=pruner,
                  server_pid=server_pid)


def prune(t: Target) -> None:
    """Rank 0 applies retention (timed, flushed); all ranks meet."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        start = time.perf_counter()
        t.pruner.apply_retention()
        os.sync()
        t.pruned.append(time.perf_counter() - start)
    dist.barrier()


def fresh_dcp_id(t: Target) -> str:
    """A fresh checkpoint id (S3: a new prefix; local: the one dir, emptied first)."""
    t.dcp_saves += 1
    if t.local:
        remove_on_rank0(t.dcp_path)
        return t.dcp_path
    return f"{t.dcp_path}/c{t.dcp_saves}"


def marind_sync(t: Target) -> float:
    t.step += 1
    state = state_of(t.model, t.optim)
    done: list = []
    took = timed(lambda: done.append(t.store.save(t.step, state, async_=False)))
    t.phases.append(done[0].timings)
    prune(t)
    return took


def marind_async(t: Target) -> AsyncSave:
    import torch
    import torch.distributed as dist

    t.step += 1
    state = state_of(t.model, t.optim)
    quiet = [train_step(t.model, t.optim, t.dim) for _ in range(QUIET_STEPS)]
    dist.barrier()
    c0 = cpu_seconds(t.server_pid) if t.server_pid else None
    writer = t.store.writer_pid                 # started by the warm-up save
    w0 = cpu_seconds(writer) if writer else None
    t0 = time.perf_counter()
    pending = t.store.save(t.step, state, async_=True)
    blocked = time.perf_counter() - t0
    during = steps_while(pending.done, t.model, t.optim, t.dim)
    pending.wait()
    blocked += pending.timings.get("step_wait_s", 0.0)   # an optimizer step that waited for the copy
    server = cpu_seconds(t.server_pid) - c0 if t.server_pid else None
    writers = torch.tensor([cpu_seconds(writer) - w0 if writer and t.store.writer_pid == writer else -1e9])
    dist.all_reduce(writers)               # every rank's writer process (negative: one restarted)
    dist.barrier()
    prune(t)
    t.writer_cpu.append(writers.item())
    return AsyncSave(blocked, pending.finished_at - t0, during, quiet, server)   # committed, not noticed


def dcp_sync(t: Target) -> float:
    import torch.distributed.checkpoint as dcp

    state = state_of(t.model, t.optim)
    cid = fresh_dcp_id(t)
    took = timed(lambda: dcp.save(state, checkpoint_id=dcp_checkpoint_id(cid),
                                  storage_writer=dcp_writer(cid, t.opts)))
    t.dcp_checkpoint_id = cid
    return took


def dcp_async(t: Target) -> AsyncSave:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = state_of(t.model, t.optim)
    cid = fresh_dcp_id(t)
    quiet = [train_step(t.model, t.optim, t.dim) for _ in range(QUIET_STEPS)]
    dist.barrier()
    c0 = cpu_seconds(t.server_pid) if t.server_pid else None
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=dcp_checkpoint_id(cid), storage_writer=dcp_writer(cid, t.opts),
                         process_group=dcp_group())
    blocked = time.perf_counter() - t0
    finished: list[float] = []
    fut.add_done_callback(lambda _f: finished.append(time.perf_counter()))
    during = steps_while(fut.done, t.model, t.optim, t.dim)
    fut.result()
    server = cpu_seconds(t.server_pid) - c0 if t.server_pid else None
    dist.barrier()
    t.dcp_checkpoint_id = cid
    return AsyncSave(blocked, (finished or [time.perf_counter()])[0] - t0, during, quiet, server)


def dcp_async_process(t: Target) -> AsyncSave:
    """DCP's best async mode: its checkpoint process, staged into shared memory."""
    import torch.distributed as dist

    if t.dcp_proc is None:
        t.dcp_proc = DcpProcessSaver()
    state = state_of(t.model, t.optim)
    cid = fresh_dcp_id(t)
    quiet = [train_step(t.model, t.optim, t.dim) for _ in range(QUIET_STEPS)]
    dist.barrier()
    c0 = cpu_seconds(t.server_pid) if t.server_pid else None
    t0 = time.perf_counter()
    fut, staging_wait = t.dcp_proc.save(state, dcp_checkpoint_id(cid), dcp_writer(cid, t.opts), dcp_group(),
                                        t.optim)
    blocked = time.perf_counter() - t0
    finished: list[float] = []
    fut.add_done_callback(lambda _f: finished.append(time.perf_counter()))
    during = steps_while(fut.done, t.model, t.optim, t.dim)
    fut.result()
    blocked += staging_wait()
    server = cpu_seconds(t.server_pid) - c0 if t.server_pid else None
    dist.barrier()
    t.dcp_checkpoint_id = cid   # the newest DCP checkpoint (either mode) is the one loaded
    return AsyncSave(blocked, (finished or [time.perf_counter()])[0] - t0, during, quiet, server)


#: system -> (sync save, async save); DCP's process-based async has no sync form of its own
RUNS = {"marind": (marind_sync, marind_async), "dcp": (dcp_sync, dcp_async),
        "dcp_process": (None, dcp_async_process)}


def alternate_saves(t: Target, repeats: int, async_repeats: int | None = None) -> dict[str, dict[str, list]]:
    """Each repeat, a sync (the first ``repeats``) and an async save (``async_repeats``, default
    ``repeats``) of each system, the systems in alternating order so that a drift in the
    machine's load favours neither; every figure, by system. A save of the bench's state
    spans one to three training steps: more async saves, more steps timed during a save."""
    got: dict[str, dict[str, list]] = {
        k: {"sync": [], "blocked": [], "commit": [], "during": [], "quiet": [], "server": []} for k in RUNS}
    for i in range(max(repeats, async_repeats or repeats)):
        for system in (list(RUNS) if i % 2 == 0 else list(reversed(RUNS))):
            sync_fn, async_fn = RUNS[system]
            g = got[system]
            if sync_fn is not None and i < repeats:
                g["sync"].append(sync_fn(t))
            run = async_fn(t)
            g["blocked"].append(run.blocked)
            g["commit"].append(run.commit)
            g["during"] += run.during
            g["quiet"] += run.quiet
            if run.server is not None:
                g["server"].append(run.server)
    return got


def save_fields(g: dict[str, list]) -> dict:
    """One system's save figures: medians, plus every sync and commit time."""
    out = dict(sync_save_s=statistics.median(g["sync"]) if g["sync"] else None,
               async_blocked_s=statistics.median(g["blocked"]),
               async_commit_s=statistics.median(g["commit"]),
               step_during_save_s=statistics.median(g["during"]) if g["during"] else None,
               steps_during_save=len(g["during"]),
               step_before_save_s=statistics.median(g["quiet"]),
               sync_all_s=[round(x, 3) for x in g["sync"]],
               commit_all_s=[round(x, 3) for x in g["commit"]],
               step_during_all_s=[round(x, 6) for x in g["during"]],
               step_before_all_s=[round(x, 6) for x in g["quiet"]])
    if g["server"]:
        out["server_cpu_during_async_s"] = statistics.median(g["server"])
    return out


def marind_background_fields(t: Target) -> dict:
    """marind's own extras: its writers' CPU during async saves, retention deletes, sync phases."""
    writers = [w for w in t.writer_cpu if w >= 0]
    return dict(
        writer_cpu_during_async_s=statistics.median(writers) if writers else None,
        retention_delete_s=statistics.median(t.pruned) if t.pruned else None,
        sync_phases_s={k: round(statistics.median(p.get(k, 0.0) for p in t.phases), 3) for k in PHASE_KEYS},
        sync_phases_all_s=[{k: round(p.get(k, 0.0), 3) for k in PHASE_KEYS} for p in t.phases])


def timed_saves(t: Target, repeats: int, async_repeats: int | None = None) -> dict:
    """One untimed save of each (the first process-based save starts DCP's daemon), then the
    timed ones in turns (``alternate_saves``); every system's save figures."""
    marind_sync(t)
    dcp_sync(t)
    dcp_async_process(t)
    t.phases.clear()
    t.pruned.clear()
    try:
        got = alternate_saves(t, repeats, async_repeats)
    finally:
        t.dcp_proc.close()
    res: dict = {"marind": {}, "dcp": {"checkpoint_id": t.dcp_checkpoint_id}, "dcp_process": {}}
    for system, g in got.items():
        res[system].update(save_fields(g))
    res["marind"].update(marind_background_fields(t))
    return res


def bench_target(name: str, url: str, opts, model, optim, dim: int, repeats: int,
                 store_kwargs: dict | None = None, server_pid: int | None = None,
                 sections: tuple[str, ...] = ("saves", "loads"), load_repeats: int | None = None,
                 async_repeats: int | None = None) -> dict:
    """marind and DCP against one target (a local dir or an S3 prefix): ``repeats`` timed
    sync saves, ``async_repeats`` (default ``repeats``) async saves, ``load_repeats`` (default
    ``repeats``) timed loads of each system.
    ``sections``: without "saves", one untimed save of each system (the checkpoints that
    the loads read); without "loads", no timed loads.

    One untimed save of each first (the first write to a fresh server or
    directory pays for its setup), then the two take turns, repeat by repeat,
    in alternating order, so that a drift in the machine's load favours neither.
    Deletes between saves are flushed (``os.sync``) before the next timed save:
    this VM's ext4 has online discard, and a save's flush (an fsync or syncfs)
    otherwise waits for the discards of whatever was deleted before it, the
    other system's checkpoint included.
    ``server_pid``: the S3 server on this machine, whose CPU time during each
    async save is reported (it competes with training for the same cores).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    t = open_target(url, opts, model, optim, dim, store_kwargs, server_pid)
    if "saves" not in sections:     # the checkpoints the loads read, untimed
        marind_sync(t)
        dcp_sync(t)
        res: dict = {"marind": {}, "dcp": {"checkpoint_id": t.dcp_checkpoint_id}}
    else:
        res = timed_saves(t, repeats, async_repeats)
    cid = res["dcp"]["checkpoint_id"]
    if "loads" not in sections:
        res["marind"]["step"] = t.store.latest()
        return res if dist.get_rank() == 0 else {}
    loads = timed_loads({
        "marind": t.store.load,
        "dcp": lambda target: dcp.load(target, checkpoint_id=dcp_checkpoint_id(cid),
                                       storage_reader=dcp_reader(cid, opts)),
    }, lambda: state_of(model, optim), load_repeats or repeats, url if t.local else None)
    for system, times in loads.items():
        res[system].update(load_fields(times))
    st = t.store.last_load_stats
    res["marind"]["read_amplification"] = st["bytes_read"] / max(1, st["bytes_needed"])
    res["marind"]["step"] = t.store.latest()
    return res if dist.get_rank() == 0 else {}


def _torch_save_full(model, optim, path: str) -> None:
    """torch.save of the full (gathered) state by rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, path)


def worker(dim: int, layers: int, repeats: int, local_dir: str, s3_url: str | None,
           s3_opts: dict | None, local: bool = True, store_kwargs: dict | None = None,
           s3_pid: int | None = None, slow_dir: str | None = None,
           sections: tuple[str, ...] = ("saves", "loads", "reshard"), load_repeats: int | None = None,
           async_repeats: int | None = None) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model, optim = build_model(dim, layers, world)
    dcp_group()
    train_step(model, optim, dim)
    state = state_of(model, optim)
    nbytes = torch.tensor([sum(v.to_local().numel() * v.element_size() for v in tensors(state))],
                          dtype=torch.int64)
    dist.all_reduce(nbytes)
    base = [train_step(model, optim, dim) for _ in range(max(5, repeats * 3))]
    out = {"world": world, "state_bytes": int(nbytes.item()), "step_s": statistics.median(base)}
    sections = tuple(sections)
    how = dict(sections=sections, load_repeats=load_repeats, async_repeats=async_repeats)   # every target's
    if local:
        out["local"] = bench_target("local", local_dir, None, model, optim, dim, repeats, store_kwargs, **how)
    if slow_dir:
        out["slow"] = bench_target("slow", slow_dir, None, model, optim, dim, repeats, store_kwargs, **how)
    if s3_url:
        out["s3"] = bench_target("s3", s3_url, s3_opts, model, optim, dim, repeats, store_kwargs, s3_pid, **how)
    if dist.get_rank() == 0:
        print(json.dumps({"partial": {k: out.get(k) for k in ("local", "slow", "s3")}}), file=sys.stderr, flush=True)
    if "saves" not in sections:
        return out if dist.get_rank() == 0 else {}
    os.makedirs(local_dir, exist_ok=True)
    full_path = f"{local_dir}/torch_save.pt"
    out["torch_save_s"] = statistics.median(timed(lambda: _torch_save_full(model, optim, full_path))
                                            for _ in range(repeats))
    return out if dist.get_rank() == 0 else {}


def reshard_worker(dim: int, layers: int, repeats: int, marind_url: str, dcp_id: str,
                   opts: dict | None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt_store import CheckpointStore

    torch.set_num_threads(1)
    model, optim = build_model(dim, layers, dist.get_world_size())
    train_step(model, optim, dim)
    store = CheckpointStore(marind_url, storage_options=opts)
    amp: list[float] = []

    def marind_load(target):
        store.load(target)
        st = store.last_load_stats
        amp.append(st["bytes_read"] / max(1, st["bytes_needed"]))

    root = None if marind_url.startswith("s3://") else os.path.dirname(marind_url.removeprefix("file://"))
    loads = timed_loads({"marind": marind_load, "dcp": lambda target: dcp.load(
        target, checkpoint_id=dcp_checkpoint_id(dcp_id), storage_reader=dcp_reader(dcp_id, opts))},
        lambda: state_of(model, optim), repeats, root)
    fields = {system: load_fields(times) for system, times in loads.items()}
    return {"marind_load_s": fields["marind"]["load_s"], "dcp_load_s": fields["dcp"]["load_s"],
            "cold_resident_bytes": max(f["cold_resident_bytes"] or 0 for f in fields.values()) if root else None,
            "marind_load_warm_s": fields["marind"]["load_warm_s"], "dcp_load_warm_s": fields["dcp"]["load_warm_s"],
            "marind_load_all_s": fields["marind"]["load_all_s"], "dcp_load_all_s": fields["dcp"]["load_all_s"],
            "marind_read_amplification": max(amp)} if dist.get_rank() == 0 else {}

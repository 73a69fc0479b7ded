"""Rank targets for the ckpt_store multi-process tests (run via procs.run_torch_workers)."""

from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt_store import CheckpointStore

SHAPES = {  # name -> (shape, dtype)
    "model/w": ((10, 7), torch.float32),
    "model/wb": ((9, 6), torch.bfloat16),
    "model/b": ((5,), torch.float32),
    "model/i": ((6, 4), torch.int64),
    "model/e": ((0, 3), torch.float32),
    "optim/w/exp_avg": ((10, 7), torch.float32),
    "optim/w/step": ((), torch.float32),
}
LAYOUTS = ["rep", "dtrep", "fsdp", "tp_row", "2d", "2d_strided"]
GATHERED = {"fsdp", "2d_strided"}   # matrix saves: small sharded arrays written whole; others per shard


def expected(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _placements(layout: str, ndim: int, world: int):
    """(mesh shape, placements) of a tensor with ``ndim`` dims under ``layout``; None = plain tensor."""
    if layout == "rep":
        return None
    if layout in ("2d", "2d_strided"):
        mesh = (2, world // 2) if world % 2 == 0 else (1, world)
        if ndim == 0:
            return mesh, (Replicate(), Replicate())
        if ndim == 1:
            return mesh, (Shard(0), Replicate())
        return mesh, (Shard(0), Shard(1))              # FSDP dim 0 + TP rowwise (dim 1)
    mesh = (world,)
    if ndim == 0 or layout == "dtrep":
        return mesh, (Replicate(),)
    if layout == "tp_row":
        return mesh, (Shard(1) if ndim >= 2 else Replicate(),)
    return mesh, (Shard(0),)


def _fsdp2_over_tp_colwise(value: torch.Tensor, mesh) -> DTensor:
    """A real FSDP2(TP colwise) parameter holding ``value`` (placements _StridedShard(0), Shard(0))."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    lin = torch.nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=value.dtype)
    with torch.no_grad():
        lin.weight.copy_(value)
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    fully_shard(lin, mesh=mesh["dp"])
    return lin.weight.data


def make_state(layout: str, zeros: bool = False) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    meshes: dict = {}
    state: dict = {"extra": {}}
    for name in SHAPES:
        value = expected(name)
        if zeros:
            value = torch.zeros_like(value)
        spec = _placements(layout, value.dim(), world)
        if spec is not None:
            mesh_shape, placements = spec
            if mesh_shape not in meshes:
                names = ("dp", "tp")[:len(mesh_shape)]
                meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            mesh = meshes[mesh_shape]
            if layout == "2d_strided" and value.dim() == 2 and value.is_floating_point() and value.numel():
                value = _fsdp2_over_tp_colwise(value, mesh)
            else:
                value = distribute_tensor(value, mesh, placements)
        node = state
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if not zeros:
        state["extra"] = {"data_pos": 123, "rank": dist.get_rank() if dist.is_initialized() else 0}
    return state


def _get(state: dict, name: str):
    for p in name.split("/"):
        state = state[p]
    return state


def check_state(state: dict) -> list[str]:
    bad = []
    for name in SHAPES:
        t = _get(state, name)
        full = t.full_tensor() if isinstance(t, DTensor) else t
        want = expected(name)
        if full.dtype != want.dtype or not torch.equal(full.view(-1).view(torch.uint8) if full.numel() else full,
                                                       want.view(-1).view(torch.uint8) if want.numel() else want):
            bad.append(name)
    if state["extra"].get("data_pos") != 123:
        bad.append("extra/data_pos")
    return bad


def matrix(url: str, save: bool, load_steps: list[int], storage_options: dict | None = None) -> dict:
    """Save one step per layout (step = world*100 + layout index), then load every step in
    ``load_steps`` (plus the ones just saved) into every layout; report failures."""
    world = dist.get_world_size()
    store = CheckpointStore(url, storage_options=storage_options, inner_chunk_bytes=64)
    saved = []
    if save:
        for i, layout in enumerate(LAYOUTS):
            step = world * 100 + i
            store.gather_small_bytes = 1 << 20 if layout in GATHERED else 0
            pending = store.save(step, make_state(layout), async_=bool(i % 2))
            pending.wait(timeout=60)
            saved.append(step)
    failures = []
    amp = []
    for step in [*load_steps, *saved]:
        for layout in LAYOUTS:
            target = make_state(layout, zeros=True)
            store.load(target, step=step)
            stats = store.last_load_stats
            if stats["bytes_needed"]:
                amp.append(stats["bytes_read"] / stats["bytes_needed"])
            bad = check_state(target)
            if bad:
                failures.append(f"step {step} -> {layout}@{world}: {bad}")
    chunks = {step: store.manifest(step)["arrays"]["model/w"]["chunks"] for step in saved}
    return {"failures": failures, "saved": saved, "steps": store.steps(), "max_amp": max(amp or [0]),
            "w_chunks": chunks}


def save_big(url: str, step: int, mb: int, rate: float | None = None, commit_timeout_s: float = 60.0,
             storage_options: dict | None = None) -> dict:
    """Save ``mb`` MiB of FSDP-sharded state; with ``rate`` the uploads are throttled."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n = mb * (1 << 20) // 4 // 1024
    state = {"model": {f"p{i}": distribute_tensor(torch.full((n // 8, 1024), float(step + i)), mesh, [Shard(0)])
                       for i in range(8)}}
    store = CheckpointStore(url, storage_options=storage_options, commit_timeout_s=commit_timeout_s,
                            io_rate_limit=rate)
    t0 = time.monotonic()
    pending = store.save(step, state, async_=True)
    try:
        pending.wait(timeout=commit_timeout_s + 30)
        return {"ok": True, "seconds": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "error": str(exc)}


def tiny_replicated(url: str, commit_timeout_s: float) -> dict:
    """One small replicated tensor over the ranks: only one rank owns its chunk, so the others
    save a part with no chunk at all (and, on a first save, an empty snapshot arena)."""
    store = CheckpointStore(url, commit_timeout_s=commit_timeout_s)
    try:
        store.save(1, {"model": {"w": torch.ones(4)}, "extra": {"rank": dist.get_rank()}}, async_=False)
        return {"ok": True, "steps": store.steps()}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "error": str(exc)}
    finally:
        store.close()


def load_fails_on_one_rank(url: str) -> dict:
    """Rank 1 asks for a shape the checkpoint does not have; rank 0 loads clean. Every rank
    must come back with an error (none left waiting in load's agreement)."""
    store = CheckpointStore(url)
    store.save(1, {"model": {"w": torch.ones(8)}}, async_=False)
    shape = 8 if dist.get_rank() == 0 else 9
    try:
        store.load({"model": {"w": torch.zeros(shape)}})
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "error": str(exc)}
    finally:
        store.close()


def load_newest(urls: list[str]) -> dict:
    """Load with no step, each rank from ``urls[rank]``: which step did every rank get?"""
    store = CheckpointStore(urls[dist.get_rank()])
    state = {"model": {"w": torch.zeros(4)}, "extra": {"step": -1}}
    store.load(state)
    return {"step": state["extra"]["step"], "w": state["model"]["w"].tolist()}


def sub_meshes(url: str) -> dict:
    """4 ranks on a (dp, tp) mesh; arrays on its sub-meshes, as FSDP2 leaves a parameter
    that tensor parallelism does not touch (each tp rank holds the same dp-sharded copy)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {"model": {
        "norm": distribute_tensor(expected("model/w"), mesh["dp"], [Shard(0)]),
        "emb": distribute_tensor(expected("optim/w/exp_avg"), mesh["tp"], [Replicate()]),
        "wb": distribute_tensor(expected("model/wb"), mesh["tp"], [Shard(1)])}}
    store = CheckpointStore(url, inner_chunk_bytes=64, gather_small_bytes=0)
    store.save(1, state, async_=False)
    return {"ok": True}


def disagreeing_save(url: str, mode: str) -> dict:
    """Rank 1 saves another step, or holds an array the others lack: every rank must refuse."""
    rank = dist.get_rank()
    state = {"model": {"w": torch.ones(4)}}
    step = 1
    if mode == "step" and rank == 1:
        step = 2
    if mode == "array" and rank == 1:
        state["model"]["only_here"] = torch.ones(2)
    store = CheckpointStore(url, commit_timeout_s=30)
    try:
        store.save(step, state, async_=False)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "error": str(exc)}
    finally:
        store.close()


def values_on_one_rank(url: str, flag: str) -> dict:
    """Rank 1 alone reads step 1's JSON values (as ``ckpt export`` does) while rank 0 waits
    outside any collective: a one-process reader must not all-gather with the group."""
    import os

    from ckpt_store.export.sharded import read_values

    store = CheckpointStore(url)
    try:
        if dist.get_rank() == 1:
            values = read_values(store, 1)
            open(flag, "w").close()
            return {"values": values}
        deadline = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"read_alone": os.path.exists(flag)}
    finally:
        store.close()


def load_newest_outcome(urls: list[str]) -> dict:
    """Load with no step, each rank from ``urls[rank]``: the step every rank got, or what it raised."""
    store = CheckpointStore(urls[dist.get_rank()])
    state = {"model": {"w": torch.zeros(4)}, "extra": {"step": -1}}
    try:
        store.load(state)
        return {"step": state["extra"]["step"]}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "error": str(exc)}
    finally:
        store.close()


def save_with_a_silent_rank(url: str, good_options: dict, silent_options: dict, differ: bool) -> dict:
    """One bounded async save (``prepare_timeout_s`` 1 s) where rank 1 reaches the store through
    ``silent_options`` (an endpoint that accepts and never answers); with ``differ`` rank 1 also
    holds an array rank 0 does not. Returns what ``save`` raised on this rank."""
    from ckpt_store import CheckpointError

    rank = dist.get_rank()
    store = CheckpointStore(url, storage_options=silent_options if rank == 1 else good_options,
                            prepare_timeout_s=1.0)
    state = {"model": {"w": torch.arange(64, dtype=torch.float32)}}
    if differ and rank == 1:
        state["model"]["v"] = torch.zeros(8)
    t0 = time.monotonic()
    try:
        store.save(1, state, async_=True)
        raised = None
    except CheckpointError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "seconds": time.monotonic() - t0}

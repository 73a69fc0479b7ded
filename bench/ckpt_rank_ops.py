"""The checkpoint benchmark's building blocks on the rank side (bench/ckpt_bench.py).

Each runs inside a rank that ``marind.testing.procs.run_torch_workers`` started
(a gloo process group on loopback): the FSDP2 model and its Adam state, a
training step, timing between barriers, page-cache eviction, loads taken in
turns, and DCP's writer/reader for a target url.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Iterator

from marind.testing.page_cache import drop_from_page_cache


def build_model(dim: int, layers: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def train_step(model, optim, dim: int) -> float:
    import torch

    t0 = time.perf_counter()
    x = torch.randn(8, dim)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - t0


def state_of(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def remove_on_rank0(path: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()   # see ckpt_workers.bench_target: a timed save must not pay for an earlier delete
    dist.barrier()


def evict(root: str) -> int:
    """Rank 0 drops ``root``'s files from the page cache (each flushed first: only clean pages
    go), then all ranks meet. DCP writes through the page cache and marind's local saves
    bypass it (O_DIRECT), so a load timed right after the saves would read one from memory
    and the other from disk; a restore after a failure reads from the disk. Returns the
    bytes of ``root``'s files still in the page cache after it (rank 0; 0 elsewhere): every
    cold load of either system should start from 0."""
    import torch.distributed as dist

    left = 0
    if dist.get_rank() == 0:
        for path in _files(root):
            drop_from_page_cache(path)
        left = sum(resident_bytes(path) for path in _files(root))
    dist.barrier()
    return left


def _files(root: str) -> Iterator[str]:
    """Every file under ``root``, at any depth."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            yield os.path.join(dirpath, f)


def preload(root: str) -> None:
    """Rank 0 reads every file of ``root`` through the page cache (into a throwaway buffer),
    then all ranks meet: a warm load then reads from memory, whichever system wrote the
    files and whichever way its cold load read them (marind's reads go around the cache)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for path in _files(root):
            with open(path, "rb", buffering=0) as fh:
                while fh.read(1 << 20):
                    pass
    dist.barrier()


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a read-only mapping, which reads
    nothing); 0 where this platform has no mincore. The store asks with ``cachestat``
    (``ckpt_store.storage.page_cache``, Linux 6.5+); this check of the bench's eviction stands
    apart from the system under test and runs on older kernels too."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    if not size or not hasattr(libc, "mincore"):
        return 0
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return 0
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                return 0
            return min(size, sum(v & 1 for v in vec) * mmap.PAGESIZE)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def timed_loads(load_fns: dict, make_target, repeats: int, evict_root: str | None) -> dict:
    """``{system: load(target)}`` taking turns in alternating order, each into a fresh
    ``make_target()`` built outside the timing: each repeat, a load from the disk (page cache
    dropped first: ``evict``) and then the same load again from memory (every file read into
    the page cache first: ``preload``). Without ``evict_root`` (S3: the server's cache is the
    server's) every load is as found."""
    out: dict = {system: {"cold": [], "warm": [], "resident": []} for system in load_fns}
    for i in range(repeats):
        for system in (list(load_fns) if i % 2 == 0 else list(reversed(load_fns))):
            if evict_root:
                out[system]["resident"].append(evict(evict_root))
                out[system]["cold"].append(_timed_load(load_fns[system], make_target))
                preload(evict_root)
            out[system]["warm"].append(_timed_load(load_fns[system], make_target))
    return out


def _timed_load(load, make_target) -> float:
    """``load`` into a fresh ``make_target()`` (built outside the timing), timed."""
    target = make_target()
    return timed(lambda: load(target))


def load_fields(times: dict) -> dict:
    """load_s: from the disk where the cache was dropped, else as found; load_warm_s: from memory;
    cold_resident_bytes: the most of the target's bytes left in the page cache at a cold load's start."""
    cold, warm = times["cold"], times["warm"]
    return {"load_s": statistics.median(cold or warm), "load_warm_s": statistics.median(warm) if cold else None,
            "load_all_s": [round(x, 3) for x in cold or warm], "load_warm_all_s": [round(x, 3) for x in warm]
            if cold else None,
            # the target's files still in the page cache as each cold load began (the eviction's check)
            "cold_resident_bytes": max(times.get("resident") or [0]) if cold else None}


def steps_while(done, model, optim, dim: int, limit: int = 200) -> list[float]:
    """Train while any rank's save is still running (every rank runs the same steps)."""
    import torch
    import torch.distributed as dist

    times = []
    while len(times) < limit:
        busy = torch.tensor([0 if done() else 1])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            break
        times.append(train_step(model, optim, dim))
    return times


_GROUP: list = []


def dcp_group():
    """DCP's async_save runs collectives in a background thread: give it its own gloo group."""
    import torch.distributed as dist

    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def dcp_checkpoint_id(url: str):
    """DCP re-creates an fsspec writer's filesystem (without our options) from checkpoint_id."""
    return None if url.startswith("s3://") else url


def dcp_writer(url: str, opts: dict | None):
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(url, **(opts or {}))
    return None


def dcp_reader(url: str, opts: dict | None):
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(url, **(opts or {}))
    return None


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tensors(tree):
    import torch
    if isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree if hasattr(tree, "to_local") else _Wrap(tree)


class _Wrap:
    def __init__(self, t):
        self.t = t

    def to_local(self):
        return self.t

    def element_size(self):
        return self.t.element_size()



"""Checkpoint benchmark: marind ckpt_store vs torch.distributed.checkpoint (DCP) and torch.save.

4 gloo ranks hold an FSDP2-sharded MLP plus its Adam state (>= 512 MB in
full mode), saved to a local dir and to a SeaweedFS S3 server started here.
Measured in the same run: sync save, async blocked time (the save call, plus
any wait of the next optimizer step for the snapshot copy), async time to
commit (from the save call to the moment it completed, as seen by rank 0; the
training loop only polls between steps), training step time while a
background save runs vs the steps just before it (a shared machine's load
drifts),
same-layout load, reshard load 4 -> 2 ranks (local loads twice each repeat:
from the disk with the page cache dropped first, which is ``load_s``, then
from memory, ``load_warm_s``; DCP writes through the page cache and marind
around it, so a load timed as found would compare memory with disk), bytes
read per byte needed, and the disk's raw sequential write and read rates.
Medians over ``--repeats``.

    python bench/ckpt_bench.py            # full (~10 min on 2 cores)
    python bench/ckpt_bench.py --quick    # tiny state, checks the output shape

The last stdout line is one JSON object (DESIGN §7).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


# ---------------------------------------------------------------- rank side
def _model(dim: int, layers: int, world: int):
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


def _train_step(model, optim, dim: int) -> float:
    import torch

    t0 = time.perf_counter()
    x = torch.randn(8, dim)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - t0


def _state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _rm(path: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()   # see _bench_target: a timed save must not pay for an earlier delete
    dist.barrier()


def _evict(root: str) -> None:
    """Rank 0 drops ``root``'s files from the page cache (each flushed first: only clean pages
    go), then all ranks meet. DCP writes through the page cache and marind's local saves
    bypass it (O_DIRECT), so a load timed right after the saves would read one from memory
    and the other from disk; a restore after a failure reads from the disk."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for dirpath, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


def _timed_loads(load_fns: dict, make_target, repeats: int, evict_root: str | None) -> dict:
    """``{system: load(target)}`` taking turns in alternating order, each into a fresh
    ``make_target()`` built outside the timing: each repeat, a load from the disk (page cache
    dropped first: ``_evict``) and then the same load again from memory. Without
    ``evict_root`` (S3: the server's cache is the server's) every load is as found."""
    out = {system: {"cold": [], "warm": []} for system in load_fns}

    def one(system: str) -> float:
        target = make_target()
        return _timed(lambda: load_fns[system](target))

    for i in range(repeats):
        for system in (list(load_fns) if i % 2 == 0 else list(reversed(load_fns))):
            if evict_root:
                _evict(evict_root)
                out[system]["cold"].append(one(system))
            out[system]["warm"].append(one(system))
    return out


def _load_fields(times: dict) -> dict:
    """load_s: from the disk where the cache was dropped, else as found; load_warm_s: from memory."""
    cold, warm = times["cold"], times["warm"]
    return {"load_s": statistics.median(cold or warm), "load_warm_s": statistics.median(warm) if cold else None,
            "load_all_s": [round(x, 3) for x in cold or warm], "load_warm_all_s": [round(x, 3) for x in warm]
            if cold else None}


def _steps_while(done, model, optim, dim: int, limit: int = 200) -> list[float]:
    """Train while any rank's save is still running (every rank runs the same steps)."""
    import torch
    import torch.distributed as dist

    times = []
    while len(times) < limit:
        busy = torch.tensor([0 if done() else 1])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            break
        times.append(_train_step(model, optim, dim))
    return times


QUIET_STEPS = 2   # steps without a save right before each async save: the slowdown's baseline
_GROUP = []


def _dcp_group():
    """DCP's async_save runs collectives in a background thread: give it its own gloo group."""
    import torch.distributed as dist

    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _cid(url: str):
    """DCP re-creates an fsspec writer's filesystem (without our options) from checkpoint_id."""
    return None if url.startswith("s3://") else url


def _dcp_writer(url: str, opts: dict | None):
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(url, **(opts or {}))
    return None


def _dcp_reader(url: str, opts: dict | None):
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(url, **(opts or {}))
    return None


def _bench_target(name: str, url: str, opts, model, optim, dim: int, repeats: int,
                  store_kwargs: dict | None = None, server_pid: int | None = None) -> dict:
    """marind and DCP against one target (a local dir or an S3 prefix).

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
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt_store import CheckpointStore

    rank = dist.get_rank()
    local = not url.startswith("s3://")
    mk_url = f"{url}/marind" if not local else f"file://{url}/marind"
    mk = CheckpointStore(mk_url, storage_options=opts, **(store_kwargs or {}))
    mk.protect(optim)   # async snapshots are copied beside forward/backward; optim.step() waits for them
    # old steps are deleted between the timed saves, as DCP's are (_rm): back-to-back saves would
    # otherwise time the previous step's deletes (queued behind its commit) inside the next save
    pruner = CheckpointStore(mk_url, storage_options=opts, keep_last=1)
    pruned: list[float] = []
    dpath = f"{url}/dcp"
    counter = {"step": 0, "dcp": 0}

    def prune() -> None:
        if rank == 0:
            t = time.perf_counter()
            pruner.apply_retention()
            os.sync()
            pruned.append(time.perf_counter() - t)
        dist.barrier()

    def dcp_target() -> str:
        """A fresh checkpoint id (S3: a new prefix; local: the one dir, emptied first)."""
        counter["dcp"] += 1
        if local:
            _rm(dpath)
            return dpath
        return f"{dpath}/c{counter['dcp']}"

    def marind_sync() -> float:
        counter["step"] += 1
        state = _state(model, optim)
        done: list = []
        t = _timed(lambda: done.append(mk.save(counter["step"], state, async_=False)))
        phases.append(done[0].timings)
        prune()
        return t

    def marind_async() -> tuple:
        counter["step"] += 1
        state = _state(model, optim)
        quiet = [_train_step(model, optim, dim) for _ in range(QUIET_STEPS)]
        dist.barrier()
        c0 = _cpu_s(server_pid) if server_pid else None
        writer = mk.writer_pid                 # started by the warm-up save
        w0 = _cpu_s(writer) if writer else None
        t0 = time.perf_counter()
        pending = mk.save(counter["step"], state, async_=True)
        blocked = time.perf_counter() - t0
        during = _steps_while(pending.done, model, optim, dim)
        pending.wait()
        blocked += pending.timings.get("step_wait_s", 0.0)   # an optimizer step that waited for the copy
        server = _cpu_s(server_pid) - c0 if server_pid else None
        writers = torch.tensor([_cpu_s(writer) - w0 if writer and mk.writer_pid == writer else -1e9])
        dist.all_reduce(writers)               # every rank's writer process (negative: one restarted)
        dist.barrier()
        prune()
        g_writers.append(writers.item())
        return blocked, pending.finished_at - t0, during, quiet, server   # committed, not noticed

    def dcp_sync() -> float:
        state = _state(model, optim)
        cid = dcp_target()
        return _timed(lambda: dcp.save(state, checkpoint_id=_cid(cid), storage_writer=_dcp_writer(cid, opts)))

    def dcp_async() -> tuple:
        state = _state(model, optim)
        cid = dcp_target()
        quiet = [_train_step(model, optim, dim) for _ in range(QUIET_STEPS)]
        dist.barrier()
        c0 = _cpu_s(server_pid) if server_pid else None
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=_cid(cid), storage_writer=_dcp_writer(cid, opts),
                             process_group=_dcp_group())
        blocked = time.perf_counter() - t0
        finished: list[float] = []
        fut.add_done_callback(lambda _f: finished.append(time.perf_counter()))
        during = _steps_while(fut.done, model, optim, dim)
        fut.result()
        server = _cpu_s(server_pid) - c0 if server_pid else None
        dist.barrier()
        res["dcp"]["checkpoint_id"] = cid
        return blocked, (finished or [time.perf_counter()])[0] - t0, during, quiet, server

    res: dict = {"marind": {}, "dcp": {}}
    phases: list = []
    g_writers: list[float] = []
    marind_sync()           # untimed warm-up, each
    dcp_sync()
    phases.clear()
    pruned.clear()
    runs = {"marind": (marind_sync, marind_async), "dcp": (dcp_sync, dcp_async)}
    got = {k: {"sync": [], "blocked": [], "commit": [], "during": [], "quiet": [], "server": []} for k in runs}
    for i in range(repeats):
        for system in (("marind", "dcp") if i % 2 == 0 else ("dcp", "marind")):
            sync_fn, async_fn = runs[system]
            g = got[system]
            g["sync"].append(sync_fn())
            blocked, commit, during, quiet, server = async_fn()
            g["blocked"].append(blocked)
            g["commit"].append(commit)
            g["during"] += during
            g["quiet"] += quiet
            if server is not None:
                g["server"].append(server)
    for system, g in got.items():
        res[system].update(sync_save_s=statistics.median(g["sync"]),
                           async_blocked_s=statistics.median(g["blocked"]),
                           async_commit_s=statistics.median(g["commit"]),
                           step_during_save_s=statistics.median(g["during"]) if g["during"] else None,
                           steps_during_save=len(g["during"]),
                           step_before_save_s=statistics.median(g["quiet"]),
                           sync_all_s=[round(x, 3) for x in g["sync"]],
                           commit_all_s=[round(x, 3) for x in g["commit"]])
        if g["server"]:
            res[system]["server_cpu_during_async_s"] = statistics.median(g["server"])
    writers = [w for w in g_writers if w >= 0]
    res["marind"].update(
        writer_cpu_during_async_s=statistics.median(writers) if writers else None,
        retention_delete_s=statistics.median(pruned) if pruned else None,
        sync_phases_s={k: round(statistics.median(p.get(k, 0.0) for p in phases), 3)
                       for k in ("prepare_s", "blocked_s", "write_s", "commit_s")},
        sync_phases_all_s=[{k: round(p.get(k, 0.0), 3) for k in ("prepare_s", "blocked_s", "write_s", "commit_s")}
                           for p in phases])
    cid = res["dcp"]["checkpoint_id"]
    loads = _timed_loads({
        "marind": mk.load,
        "dcp": lambda target: dcp.load(target, checkpoint_id=_cid(cid), storage_reader=_dcp_reader(cid, opts)),
    }, lambda: _state(model, optim), repeats, url if local else None)
    for system, times in loads.items():
        res[system].update(_load_fields(times))
    st = mk.last_load_stats
    res["marind"]["read_amplification"] = st["bytes_read"] / max(1, st["bytes_needed"])
    res["marind"]["step"] = mk.latest()
    return res if rank == 0 else {}


def worker(dim: int, layers: int, repeats: int, local_dir: str, s3_url: str | None,
           s3_opts: dict | None, local: bool = True, store_kwargs: dict | None = None,
           s3_pid: int | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model, optim = _model(dim, layers, world)
    _dcp_group()
    _train_step(model, optim, dim)
    state = _state(model, optim)
    nbytes = torch.tensor([sum(v.to_local().numel() * v.element_size() for v in _tensors(state))],
                          dtype=torch.int64)
    dist.all_reduce(nbytes)
    base = [_train_step(model, optim, dim) for _ in range(max(5, repeats * 3))]
    out = {"world": world, "state_bytes": int(nbytes.item()), "step_s": statistics.median(base)}
    if local:
        out["local"] = _bench_target("local", local_dir, None, model, optim, dim, repeats, store_kwargs)
    if s3_url:
        out["s3"] = _bench_target("s3", s3_url, s3_opts, model, optim, dim, repeats, store_kwargs, s3_pid)
    if dist.get_rank() == 0:
        print(json.dumps({"partial": {k: out.get(k) for k in ("local", "s3")}}), file=sys.stderr, flush=True)
    # torch.save of the full (gathered) state by rank 0
    os.makedirs(local_dir, exist_ok=True)
    full_path = f"{local_dir}/torch_save.pt"

    def full_save():
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save({"model": msd, "optim": osd}, full_path)
    out["torch_save_s"] = statistics.median(_timed(full_save) for _ in range(repeats))
    return out if dist.get_rank() == 0 else {}


def reshard_worker(dim: int, layers: int, repeats: int, marind_url: str, dcp_id: str,
                   opts: dict | None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt_store import CheckpointStore

    torch.set_num_threads(1)
    model, optim = _model(dim, layers, dist.get_world_size())
    _train_step(model, optim, dim)
    store = CheckpointStore(marind_url, storage_options=opts)
    amp = []

    def marind_load(target):
        store.load(target)
        st = store.last_load_stats
        amp.append(st["bytes_read"] / max(1, st["bytes_needed"]))

    root = None if marind_url.startswith("s3://") else os.path.dirname(marind_url.removeprefix("file://"))
    loads = _timed_loads({"marind": marind_load, "dcp": lambda target: dcp.load(
        target, checkpoint_id=_cid(dcp_id), storage_reader=_dcp_reader(dcp_id, opts))},
        lambda: _state(model, optim), repeats, root)
    fields = {system: _load_fields(times) for system, times in loads.items()}
    return {"marind_load_s": fields["marind"]["load_s"], "dcp_load_s": fields["dcp"]["load_s"],
            "marind_load_warm_s": fields["marind"]["load_warm_s"], "dcp_load_warm_s": fields["dcp"]["load_warm_s"],
            "marind_load_all_s": fields["marind"]["load_all_s"], "dcp_load_all_s": fields["dcp"]["load_all_s"],
            "marind_read_amplification": max(amp)} if dist.get_rank() == 0 else {}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tensors(tree):
    import torch
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree if hasattr(tree, "to_local") else _Wrap(tree)


class _Wrap:
    def __init__(self, t):
        self.t = t

    def to_local(self):
        return self.t

    def element_size(self):
        return self.t.element_size()


# ---------------------------------------------------------------- driver side
def disk_write_rate(directory: str, mb: int, repeats: int = 3) -> dict:
    """Raw sequential write rate (MB/s) of ``directory``'s disk, one stream, median of
    ``repeats``: 1 MiB buffered writes + fsync, and 4 MiB O_DIRECT writes + fsync (the
    path marind's large objects take). A VM that hands free pages back to its host
    makes the buffered figure swing several-fold from run to run; ``best`` is the
    higher median of the two."""
    import mmap
    block = os.urandom(4 << 20)
    path = os.path.join(directory, "rawwrite.bin")

    def buffered() -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            for i in range(mb):
                fh.write(memoryview(block)[(i % 4) << 20:((i % 4) + 1) << 20])
            fh.flush()
            os.fsync(fh.fileno())
        return mb / (time.perf_counter() - t0)

    def direct() -> float | None:
        if not hasattr(os, "O_DIRECT"):
            return None
        buf = mmap.mmap(-1, len(block))
        buf[:] = block
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            return None
        t0 = time.perf_counter()
        try:
            for _ in range(mb // 4):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        return mb // 4 * 4 / (time.perf_counter() - t0)

    rates: dict = {"buffered": [], "direct": []}
    for _ in range(repeats):
        for kind, fn in (("buffered", buffered), ("direct", direct)):
            rate = fn()
            if os.path.exists(path):
                os.remove(path)
            if rate is not None:
                rates[kind].append(rate)
    out = {k: round(statistics.median(v), 1) for k, v in rates.items() if v}
    out["best"] = max(out.values())
    return out


def disk_read_rate(directory: str, mb: int, repeats: int = 3) -> float | None:
    """Raw sequential read rate (MB/s) of ``directory``'s disk: one stream of 4 MiB O_DIRECT
    reads of a file written for it, median of ``repeats`` (None where O_DIRECT is refused).
    A load from a cold cache cannot beat it by much (each rank reads its own objects)."""
    import mmap
    if not hasattr(os, "O_DIRECT"):
        return None
    path = os.path.join(directory, "rawread.bin")
    buf = mmap.mmap(-1, 4 << 20)
    buf[:] = os.urandom(4 << 20)
    try:
        with open(path, "wb") as fh:
            for _ in range(mb // 4):
                fh.write(buf)
            fh.flush()
            os.fsync(fh.fileno())
        rates = []
        for _ in range(repeats):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                while os.readv(fd, [buf]) == len(buf):
                    pass
                rates.append(mb // 4 * 4 / (time.perf_counter() - t0))
            finally:
                os.close(fd)
        return round(statistics.median(rates), 1)
    except OSError:
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny state, one repeat (checks the JSON shape)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-local", action="store_true", help="S3 only (no local target, no reshard)")
    ap.add_argument("--store-options", default=None, help="JSON of extra CheckpointStore keywords "
                    '(e.g. \'{"writer_nice": 10}\')')
    ap.add_argument("--dir", default=None, help="local checkpoint dir (default: a temp dir)")
    args = ap.parse_args(argv)
    from marind.testing.procs import kill_all, run_torch_workers
    from marind.testing.s3_server import SeaweedS3

    dim, layers = (128, 2) if args.quick else (2048, 12)     # full: 50M params + Adam = 604 MB
    repeats = args.repeats or (1 if args.quick else 3)
    root = Path(args.dir or tempfile.mkdtemp(prefix="marind-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    s3 = None
    store_kwargs = json.loads(args.store_options) if args.store_options else {}
    result: dict = {"bench": "ckpt", "quick": args.quick, "repeats": repeats, "store_options": store_kwargs}
    try:
        raw = disk_write_rate(str(root), 64 if args.quick else 512)
        result["disk_write_MBps"], result["disk_write_MBps_by_path"] = raw["best"], raw
        result["disk_read_MBps"] = disk_read_rate(str(root), 64 if args.quick else 512)
        s3_url = s3_opts = None
        if not args.no_s3:
            s3 = SeaweedS3(root / "s3").start()
            s3_url, s3_opts = s3.url("bench"), s3.storage_options
        env = {"OMP_NUM_THREADS": "1", "MARIND_LOG_LEVEL": "WARNING"}
        r = run_torch_workers("bench.ckpt_bench:worker", 4, timeout=3000, env=env, dim=dim, layers=layers,
                              repeats=repeats, local_dir=str(root / "local"), s3_url=s3_url,
                              s3_opts=s3_opts, local=not args.no_local, store_kwargs=store_kwargs,
                              s3_pid=s3.pid if s3 else None)[0]
        result.update({k: r[k] for k in ("world", "state_bytes", "step_s", "torch_save_s")})
        result["cpus"] = len(os.sched_getaffinity(0))
        result["local"], result["s3"] = r.get("local"), r.get("s3")
        if not args.no_local:
            result["reshard_4_to_2_local"] = run_torch_workers(
                "bench.ckpt_bench:reshard_worker", 2, timeout=3000, env=env, dim=dim, layers=layers,
                repeats=repeats, marind_url=f"file://{root}/local/marind",
                dcp_id=r["local"]["dcp"]["checkpoint_id"], opts=None)[0]
        result["ratios"] = _ratios(result)
    finally:
        kill_all()
        if s3:
            s3.stop()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


def _ratios(res: dict) -> dict:
    out: dict = {}
    for target in ("local", "s3"):
        t = res.get(target)
        if not t:
            continue
        m, d = t["marind"], t["dcp"]
        out[target] = {
            "sync_save_vs_dcp": _ratio(m["sync_save_s"], d["sync_save_s"]),
            "load_vs_dcp": _ratio(m["load_s"], d["load_s"]),
            "load_warm_vs_dcp": _ratio(m.get("load_warm_s"), d.get("load_warm_s")),
            "async_blocked_vs_own_sync": _ratio(m["async_blocked_s"], m["sync_save_s"]),
            "async_commit_vs_own_sync": _ratio(m["async_commit_s"], m["sync_save_s"]),
            "step_slowdown_during_save": _ratio(m["step_during_save_s"], m["step_before_save_s"]),
            "dcp_step_slowdown_during_save": _ratio(d["step_during_save_s"], d["step_before_save_s"]),
            "sync_save_vs_torch_save": _ratio(m["sync_save_s"], res["torch_save_s"]) if target == "local" else None,
        }
        if m.get("server_cpu_during_async_s") is not None:
            # the share of the machine the S3 server itself took while marind's async save ran, and
            # the step slowdown that share alone forces on a training loop that keeps every core busy
            share = m["server_cpu_during_async_s"] / (res["cpus"] * m["async_commit_s"])
            out[target]["server_cpu_share_during_async"] = round(share, 3)
            out[target]["step_slowdown_from_server_alone"] = round(1 / (1 - share), 3) if share < 1 else None
        if m.get("writer_cpu_during_async_s") is not None:
            # the same for marind's own background work (the ranks' writer processes)
            share = m["writer_cpu_during_async_s"] / (res["cpus"] * m["async_commit_s"])
            out[target]["writer_cpu_share_during_async"] = round(share, 3)
            out[target]["step_slowdown_from_writers_alone"] = round(1 / (1 - share), 3) if share < 1 else None
    rs = res.get("reshard_4_to_2_local") or {}
    out["reshard_load_vs_dcp"] = _ratio(rs.get("marind_load_s"), rs.get("dcp_load_s"))
    out["reshard_load_warm_vs_dcp"] = _ratio(rs.get("marind_load_warm_s"), rs.get("dcp_load_warm_s"))
    if res.get("local") and res.get("disk_write_MBps"):
        mbps = res["state_bytes"] / 1e6 / res["local"]["marind"]["sync_save_s"]
        out["local_save_MBps"] = round(mbps, 1)
        out["local_save_vs_raw_disk"] = round(mbps / (res["disk_write_MBps"] * 1.048576), 3)
    if res.get("local") and res.get("disk_read_MBps"):
        mbps = res["state_bytes"] / 1e6 / res["local"]["marind"]["load_s"]
        out["local_load_MBps"] = round(mbps, 1)
        out["local_load_vs_raw_disk_read"] = round(mbps / (res["disk_read_MBps"] * 1.048576), 3)
    return out


if __name__ == "__main__":
    sys.exit(main())

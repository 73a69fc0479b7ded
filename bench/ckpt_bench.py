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

The last stdout line is one JSON object (docs/design.md §7). The ranks run
``bench/ckpt_workers.py`` (built from ``bench/ckpt_rank_ops.py``).
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

from marind.testing.procs import kill_all, run_torch_workers
from marind.testing.s3_server import SeaweedS3


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
        r = run_torch_workers("bench.ckpt_workers:worker", 4, timeout=3000, env=env, dim=dim, layers=layers,
                              repeats=repeats, local_dir=str(root / "local"), s3_url=s3_url,
                              s3_opts=s3_opts, local=not args.no_local, store_kwargs=store_kwargs,
                              s3_pid=s3.pid if s3 else None)[0]
        result.update({k: r[k] for k in ("world", "state_bytes", "step_s", "torch_save_s")})
        result["cpus"] = len(os.sched_getaffinity(0))
        result["local"], result["s3"] = r.get("local"), r.get("s3")
        if not args.no_local:
            result["reshard_4_to_2_local"] = run_torch_workers(
                "bench.ckpt_workers:reshard_worker", 2, timeout=3000, env=env, dim=dim, layers=layers,
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

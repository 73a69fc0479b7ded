"""Checkpoint benchmark: marind ckpt_store vs torch.distributed.checkpoint (DCP) and torch.save.

4 gloo ranks hold an FSDP2-sharded MLP plus its Adam state (>= 512 MB in
full mode), saved to a local dir on the machine's disk (``local``), to a slow
disk the bench sets up and removes (``slow``: a loop-mounted ext4 image capped
at ``--slow-MBps``, 240 by default, by the block I/O throttle;
``marind/testing/slow_disk.py``; root only, else one line on stderr and
``slow_target.error`` in the JSON) and to a SeaweedFS S3 server started here.
DCP runs as its sync ``save``, its thread-based ``async_save`` (``dcp``) and
its best async mode, the process-based one with shared-memory staging
(``dcp_process``: ``AsyncCheckpointerType.PROCESS`` + ``DefaultStager``).
Measured in the same run: sync save, async blocked time (the save call, plus
any wait of the next optimizer step for the snapshot copy), async time to
commit (from the save call to the moment it completed, as seen by rank 0; the
training loop only polls between steps), training step time while a
background save runs vs the steps just before it (a shared machine's load
drifts),
same-layout load, reshard load 4 -> 2 ranks (local loads twice each repeat:
from the disk with the page cache dropped first, which is ``load_s``, then
from memory, ``load_warm_s``, every file read into the page cache first; DCP
writes and reads through the page cache and marind around it, so a load timed
as found would compare memory with disk), bytes
read per byte needed, and the disk's raw sequential write and read rates.
Medians over ``--repeats`` (sync saves), ``--async-repeats`` (async saves) and
``--load-repeats`` (loads); a step slowdown is the median step during a system's async
saves over the median of every system's steps just before theirs (``quiet_step_s``).

    python bench/ckpt_bench.py --repeats 3   # full: local, slow target and S3 (the long run; docs/perf.md)
    python bench/ckpt_bench.py --quick    # tiny state, checks the output shape
    python bench/ckpt_bench.py --sections reshard --no-s3 --no-slow --repeats 7   # the reshard loads only

``--sections`` picks what is timed, of ``saves`` (sync and async saves, torch.save),
``loads`` (same-layout loads) and ``reshard`` (4 -> 2 loads); default all. Without
``saves`` each target gets one untimed save of each system, the checkpoints the loads
read; with ``reshard`` alone S3 is skipped (it has no reshard case).

The last stdout line is one JSON object (docs/design.md §7). The ranks run
``bench/ckpt_workers.py`` (built from ``bench/ckpt_rank_ops.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from marind.testing.procs import exit_on_sigterm, kill_all, run_torch_workers
from marind.testing.s3_server import SeaweedS3
from marind.testing.slow_disk import SlowDiskUnavailable, slow_disk


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


#: timed loads of each kind by default (``--load-repeats``): cold loads of either system
#: spread widely on a small shared machine (docs/perf.md), so a median of 3 turns on one draw
LOAD_REPEATS = 7

#: what one run can time (``--sections``)
SECTIONS = ("saves", "loads", "reshard")


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny state, one repeat (checks the JSON shape)")
    ap.add_argument("--repeats", type=int, default=None, help="timed saves of each kind (default 3; --quick 1)")
    ap.add_argument("--async-repeats", type=int, default=None,
                    help="timed async saves of each system (default: 2 x --repeats; --quick 1; at least "
                         "--repeats): each spans only one to three training steps")
    ap.add_argument("--load-repeats", type=int, default=None,
                    help="timed loads of each kind (default: 7, or --repeats if more; --quick 1): a cold "
                         "load is short and varies widely on a shared machine")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-local", action="store_true", help="S3 only (no local target, no reshard)")
    ap.add_argument("--store-options", default=None, help="JSON of extra CheckpointStore keywords "
                    '(e.g. \'{"writer_nice": 10}\')')
    ap.add_argument("--dir", default=None, help="local checkpoint dir (default: a temp dir)")
    ap.add_argument("--no-slow", action="store_true", help="no slow target")
    ap.add_argument("--slow-MBps", type=float, default=240.0, help="the slow target's read and write cap")
    ap.add_argument("--slow-base", default=None, help="a dir on a real disk for the slow target's image "
                    "(default: the system temp dir)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated parts to time, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    sections = [x for x in SECTIONS if x in set(args.sections.split(","))]
    if not sections or not set(args.sections.split(",")) <= set(SECTIONS):
        ap.error(f"--sections {args.sections!r}: use some of {', '.join(SECTIONS)}")
    if sections == ["reshard"]:
        if args.no_local:
            ap.error("--sections reshard with --no-local: the reshard loads read the local target")
        args.no_s3 = True        # S3 has no reshard case
    args.sections = sections

    dim, layers = (128, 2) if args.quick else (2048, 12)     # full: 50M params + Adam = 604 MB
    repeats = args.repeats or (1 if args.quick else 3)
    load_repeats = args.load_repeats or (1 if args.quick else max(repeats, LOAD_REPEATS))
    async_repeats = max(repeats, args.async_repeats or (1 if args.quick else 2 * repeats))
    root = Path(args.dir or tempfile.mkdtemp(prefix="marind-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    store_kwargs = json.loads(args.store_options) if args.store_options else {}
    result: dict = {"bench": "ckpt", "quick": args.quick, "repeats": repeats, "load_repeats": load_repeats,
                    "async_repeats": async_repeats, "store_options": store_kwargs,
                    "sections": args.sections}
    with contextlib.ExitStack() as stack:
        slow = None if args.no_local or args.no_slow else _open_slow(stack, args, result, dim, layers)
        try:
            _run(args, result, root, slow, dim, layers, (repeats, load_repeats, async_repeats), store_kwargs)
        finally:
            kill_all()
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


def _open_slow(stack: contextlib.ExitStack, args, result: dict, dim: int, layers: int):
    """Set up the slow target (undone by ``stack``); None, with the reason on stderr and in the
    JSON, where this machine cannot."""
    state = 12 * layers * (dim * dim + dim)          # params + Adam's two moments, fp32 bytes
    size = max(1 << 30, 4 * state + (768 << 20))    # two marind steps, one DCP, the raw-rate files
    base = args.slow_base or tempfile.gettempdir()
    try:
        slow = stack.enter_context(slow_disk(base, size, int(args.slow_MBps * 1e6)))
    except (SlowDiskUnavailable, OSError) as exc:
        print(f"ckpt_bench: no slow target: {exc}", file=sys.stderr)
        result["slow_target"] = {"error": str(exc)}
        return None
    result["slow_target"] = {"rate_MBps": args.slow_MBps, "throttle": slow.throttle, "size_bytes": size,
                             "device": slow.device}
    return slow


def _run(args, result: dict, root: Path, slow, dim: int, layers: int, repeats: tuple[int, int, int],
         store_kwargs: dict) -> None:
    """``repeats``: (timed sync saves, timed loads, timed async saves) of each system."""
    s3 = None
    try:
        saves = "saves" in args.sections
        if saves:
            raw = disk_write_rate(str(root), 64 if args.quick else 512)
            result["disk_write_MBps"], result["disk_write_MBps_by_path"] = raw["best"], raw
        result["disk_read_MBps"] = disk_read_rate(str(root), 64 if args.quick else 512)
        if slow:
            if saves:
                raw = disk_write_rate(slow.path, 32 if args.quick else 256, repeats=1 if args.quick else 2)
                result["slow_target"].update(disk_write_MBps=raw["best"], disk_write_MBps_by_path=raw)
            result["slow_target"]["disk_read_MBps"] = disk_read_rate(slow.path, 32 if args.quick else 256,
                                                                     repeats=1 if args.quick else 2)
        s3_url = s3_opts = None
        if not args.no_s3:
            s3 = SeaweedS3(root / "s3").start()
            s3_url, s3_opts = s3.url("bench"), s3.storage_options
        env = {"OMP_NUM_THREADS": "1", "MARIND_LOG_LEVEL": "WARNING"}
        r = run_torch_workers("bench.ckpt_workers:worker", 4, timeout=3000, env=env, dim=dim, layers=layers,
                              repeats=repeats[0], load_repeats=repeats[1], async_repeats=repeats[2],
                              local_dir=str(root / "local"), s3_url=s3_url,
                              s3_opts=s3_opts, local=not args.no_local, store_kwargs=store_kwargs,
                              s3_pid=s3.pid if s3 else None, slow_dir=f"{slow.path}/ckpt" if slow else None,
                              sections=args.sections)[0]
        result.update({k: r.get(k) for k in ("world", "state_bytes", "step_s", "torch_save_s")})
        result["cpus"] = len(os.sched_getaffinity(0))
        result["local"], result["slow"], result["s3"] = r.get("local"), r.get("slow"), r.get("s3")
        for target, tdir in (("local", str(root / "local")), ("slow", f"{slow.path}/ckpt" if slow else None)):
            if result[target] and tdir and "reshard" in args.sections:
                result[f"reshard_4_to_2_{target}"] = run_torch_workers(
                    "bench.ckpt_workers:reshard_worker", 2, timeout=3000, env=env, dim=dim, layers=layers,
                    repeats=repeats[1], marind_url=f"file://{tdir}/marind",
                    dcp_id=r[target]["dcp"]["checkpoint_id"], opts=None)[0]
        result["ratios"] = _ratios(result)
    finally:
        if s3:
            s3.stop()


def _ratios(res: dict) -> dict:
    """Every ratio of the run, by target; ``*_vs_dcp`` names DCP's mode it compares with
    (``dcp``: thread-based async, ``dcp_process``: its checkpoint process)."""
    out: dict = {}
    for target in ("local", "slow", "s3"):
        t = res.get(target)
        if not t:
            continue
        m, d, dp = t["marind"], t["dcp"], t.get("dcp_process") or {}   # a section not run: its keys absent
        # the steps just before each async save, every system's: the same steps on the same machine
        # with no save running, so one baseline for all (a system's own few would hand it its noise)
        quiet = [x for s in (m, d, dp) for x in s.get("step_before_all_s") or []]
        base = statistics.median(quiet) if quiet else None
        out[target] = {
            "sync_save_vs_dcp": _ratio(m.get("sync_save_s"), d.get("sync_save_s")),
            "load_vs_dcp": _ratio(m.get("load_s"), d.get("load_s")),
            "load_warm_vs_dcp": _ratio(m.get("load_warm_s"), d.get("load_warm_s")),
            "async_blocked_vs_own_sync": _ratio(m.get("async_blocked_s"), m.get("sync_save_s")),
            "async_commit_vs_own_sync": _ratio(m.get("async_commit_s"), m.get("sync_save_s")),
            "async_commit_vs_dcp_thread": _ratio(m.get("async_commit_s"), d.get("async_commit_s")),
            "async_commit_vs_dcp_process": _ratio(m.get("async_commit_s"), dp.get("async_commit_s")),
            "async_blocked_vs_dcp_process": _ratio(m.get("async_blocked_s"), dp.get("async_blocked_s")),
            "step_slowdown_during_save": _ratio(m.get("step_during_save_s"), base),
            "dcp_step_slowdown_during_save": _ratio(d.get("step_during_save_s"), base),
            "dcp_process_step_slowdown_during_save": _ratio(dp.get("step_during_save_s"), base),
            "quiet_step_s": round(base, 4) if base else None,
            "sync_save_vs_torch_save": _ratio(m.get("sync_save_s"), res.get("torch_save_s"))
            if target == "local" else None,
        }
        for who, key in (("server", "server_cpu_during_async_s"), ("writers", "writer_cpu_during_async_s")):
            if m.get(key) is not None and m.get("async_commit_s"):
                # the share of the machine the S3 server (or marind's writer processes) took while
                # marind's async save ran, and the step slowdown that share alone forces on a
                # training loop that keeps every core busy
                share = m[key] / (res["cpus"] * m["async_commit_s"])
                name = "server" if who == "server" else "writer"
                out[target][f"{name}_cpu_share_during_async"] = round(share, 3)
                out[target][f"step_slowdown_from_{who}_alone"] = round(1 / (1 - share), 3) if share < 1 else None
        rs = res.get(f"reshard_4_to_2_{target}") or {}
        if rs:
            out[target]["reshard_load_vs_dcp"] = _ratio(rs.get("marind_load_s"), rs.get("dcp_load_s"))
            out[target]["reshard_load_warm_vs_dcp"] = _ratio(rs.get("marind_load_warm_s"), rs.get("dcp_load_warm_s"))
        disk = res if target == "local" else res.get("slow_target", {}) if target == "slow" else {}
        if disk.get("disk_write_MBps") and m.get("sync_save_s"):
            mbps = res["state_bytes"] / 1e6 / m["sync_save_s"]
            out[target]["save_MBps"] = round(mbps, 1)
            out[target]["save_vs_raw_disk"] = round(mbps / (disk["disk_write_MBps"] * 1.048576), 3)
        if disk.get("disk_read_MBps") and m.get("load_s"):
            mbps = res["state_bytes"] / 1e6 / m["load_s"]
            out[target]["load_MBps"] = round(mbps, 1)
            out[target]["load_vs_raw_disk_read"] = round(mbps / (disk["disk_read_MBps"] * 1.048576), 3)
    # the names the earlier figures used (docs, the issue notes)
    for old, target, key in (("reshard_load_vs_dcp", "local", "reshard_load_vs_dcp"),
                             ("reshard_load_warm_vs_dcp", "local", "reshard_load_warm_vs_dcp"),
                             ("local_save_MBps", "local", "save_MBps"),
                             ("local_save_vs_raw_disk", "local", "save_vs_raw_disk"),
                             ("local_load_MBps", "local", "load_MBps"),
                             ("local_load_vs_raw_disk_read", "local", "load_vs_raw_disk_read")):
        if key in out.get(target, {}):
            out[old] = out[target][key]
    return out


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

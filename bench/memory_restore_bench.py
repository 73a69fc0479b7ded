"""Restore bench (issue 33): one checkpoint loaded from peer memory, from a cold local disk and from S3.

4 gloo ranks on two "hosts" (h0, h1: ranks 0-1 and 2-3, each host with its own memory
directory and transfer server; one machine, so "the network" is loopback) save one step of
``--mb`` MB (default 604, the checkpoint bench's state) into the memory tier, a local
directory and a SeaweedFS S3 server started here. Then each source is loaded, ``--repeats``
times (median):

* ``same``: the same 4 ranks (memory: each host reads its own memory; a rank reads its
  host's copies, the other host's over TCP);
* ``reshard``: h1 powered off (its memory directory deleted), 2 ranks on h0 load into a
  world of 2: the memory tier restores h1's parts from the replica in h0's memory.

Local-disk loads drop the checkpoint's pages from the page cache first (a cold read);
memory is memory. The last stdout line is one JSON object; the baseline is the local disk
(``ratios``: memory / disk, memory / S3).

    python bench/memory_restore_bench.py --quick         # 16 MB, checks the output shape
    python bench/memory_restore_bench.py --repeats 3     # the 604 MB run (docs/perf.md)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from marind.testing.page_cache import drop_from_page_cache
from marind.testing.procs import run_torch_workers
from marind.testing.s3_server import SeaweedS3

W = "bench.memory_restore_workers"


def _cold(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            drop_from_page_cache(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=604)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 MB, one repeat")
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args(argv)
    mb, repeats = (16, 1) if args.quick else (args.mb, args.repeats)
    tmp = Path(tempfile.mkdtemp(prefix="mem-restore-"))
    base = f"/dev/shm/marind-bench-{uuid.uuid4().hex[:8]}"
    run = "bench"
    s3 = None
    try:
        urls = [f"file://{tmp}/disk"]
        opts = None
        if not args.no_s3:
            s3 = SeaweedS3(tmp / "s3").start()
            urls.append(s3.url("bench", "ckpt"))
            opts = s3.storage_options
        hosts = ["h0", "h0", "h1", "h1"]
        saved = run_torch_workers(f"{W}:save_all", 4, timeout=1800, mb=mb, base=base, run=run, hosts=hosts,
                                  urls=urls, s3_opts=opts)[0]
        result: dict = {"mb": mb, "ranks": 4, "repeats": repeats, "saves": saved, "loads": {}}
        plan = [("same", 4, hosts), ("reshard", 2, ["h0", "h0"])]
        for case, world, case_hosts in plan:
            if case == "reshard":
                shutil.rmtree(f"{base}/{run}/h1")          # h1 powered off: its memory is gone
            for source, url in [("memory", "")] + [(u.split(":")[0], u) for u in urls]:
                times = []
                for _ in range(repeats):
                    if source == "file":
                        _cold(tmp / "disk")
                    got = run_torch_workers(f"{W}:load_one", world, timeout=1800, mb=mb, source=source, base=base,
                                            run=run, hosts=case_hosts, url=url, s3_opts=opts)
                    assert all(g["ok"] for g in got), got
                    times.append(got[0]["load_s"])
                result["loads"][f"{case}:{source}"] = round(statistics.median(times), 4)
        loads = result["loads"]
        result["baseline"] = "file (cold local disk)"
        result["ratios"] = {f"{case}:memory/{src}": round(loads[f"{case}:memory"] / loads[f"{case}:{src}"], 3)
                            for case, _, _ in plan for src in ("file", "s3") if f"{case}:{src}" in loads}
        print(json.dumps(result))
        return 0
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from marind.testing.procs import exit_on_sigterm
    exit_on_sigterm()       # its servers stop (finally) on SIGTERM too
    sys.exit(main())

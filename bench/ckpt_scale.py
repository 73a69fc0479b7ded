"""Checkpoint scale benchmark: save, commit and load time as arrays and ranks grow, DCP beside.

Two sweeps of small float32 arrays, each a DTensor sharded along dim 0 over all
ranks (``bench/ckpt_scale_workers.py``), on the machine's disk:

* arrays: 100 -> 1,000 -> 10,000 arrays of 64 x 16 on ``--arrays-world`` ranks
  (default 2): metadata dominates (each array is 4 KiB);
* ranks: 1 -> 2 -> 4 -> 8 gloo processes, 1,000 arrays of 64 x 16.

marind runs with ``gather_small_bytes=0`` here, so that every array has one object per
rank (FSDP's layout for arrays too big to gather): the case where per-array, per-rank
metadata work costs most. ``--gather`` keeps the default (small arrays gathered and
written whole). Each point: one untimed save, then ``--repeats`` timed sync saves
(the commit included), loads, and async saves (how long the call holds the caller:
``*_blocked_s``, DCP's thread-based ``async_save``) of each system, medians.

The growth exponent of each figure is the least-squares slope of log(time) against
log(arrays) (or log(ranks)): 1.0 is linear. The floor (issue 21): marind's save
(commit included) grows at most linearly, exponent <= 1.1.

    python bench/ckpt_scale.py             # full
    python bench/ckpt_scale.py --quick     # small sweeps, checks the output shape

The last stdout line is one JSON object (docs/design.md §7).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from marind.testing.procs import exit_on_sigterm, kill_all, run_torch_workers

FIGURES = ("marind_save_s", "marind_commit_s", "marind_load_s", "dcp_save_s", "dcp_load_s", "marind_blocked_s",
           "dcp_blocked_s")


def slope(xs: list[float], ys: list[float]) -> float | None:
    """The least-squares slope of log(y) on log(x): the growth exponent (None: fewer than two
    points, or a time that is not positive).

    Args:
        xs: sizes (arrays or ranks); ys: the times measured at them.

    Returns:
        The exponent, rounded to 3 places.
    """
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len(pts) < 2 or len(pts) != len(xs):
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 3) if den else None


def exponents(points: list[dict], by: str) -> dict:
    """The growth exponent of every figure over ``points`` (each a worker's result), against ``by``."""
    xs = [p[by] for p in points]
    return {f: slope(xs, [p[f] for p in points]) for f in FIGURES}


def sweep(root: Path, by: str, sizes: list[int], fixed: int, rows: int, cols: int, repeats: int,
          store_kwargs: dict, timeout: float) -> list[dict]:
    """One point per size: a fresh world (``by == "ranks"``: of that many ranks, ``fixed`` arrays;
    else ``fixed`` ranks and that many arrays) in a fresh directory."""
    points = []
    env = {"OMP_NUM_THREADS": "1", "MARIND_LOG_LEVEL": "WARNING"}
    for n in sizes:
        world, arrays = (n, fixed) if by == "ranks" else (fixed, n)
        out = root / f"{by}-{n}"
        r = run_torch_workers("bench.ckpt_scale_workers:worker", world, timeout=timeout, env=env,
                              root=str(out), arrays=arrays, rows=rows, cols=cols, repeats=repeats,
                              store_kwargs=store_kwargs)[0]
        shutil.rmtree(out, ignore_errors=True)
        r.pop("at", None)
        points.append({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
        print(json.dumps({"point": by, **points[-1]}), file=sys.stderr, flush=True)
    return points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sweeps, one repeat (checks the JSON shape)")
    ap.add_argument("--repeats", type=int, default=None, help="timed saves and loads per point (default 2; quick 1)")
    ap.add_argument("--arrays-world", type=int, default=2, help="ranks in the arrays sweep")
    ap.add_argument("--gather", action="store_true", help="keep marind's small-array gathering (default: off)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on the machine's disk)")
    ap.add_argument("--arrays", default=None, help="the arrays sweep's sizes, comma-separated (default 100,1000,10000)")
    ap.add_argument("--ranks", default=None, help="the ranks sweep's world sizes, comma-separated (default 1,2,4,8; "
                    "empty: no ranks sweep)")
    args = ap.parse_args(argv)
    if args.arrays_world < 1 or (args.repeats is not None and args.repeats < 1):
        print("ckpt_scale: --arrays-world and --repeats must be >= 1", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 2)
    if args.quick:
        array_sizes, rank_sizes, ranks_arrays, rows, cols = [10, 40], [1, 2], 20, 16, 8
    else:
        array_sizes, rank_sizes, ranks_arrays, rows, cols = [100, 1000, 10000], [1, 2, 4, 8], 1000, 64, 16
    try:
        if args.arrays is not None:
            array_sizes = [int(x) for x in args.arrays.split(",") if x]
        if args.ranks is not None:
            rank_sizes = [int(x) for x in args.ranks.split(",") if x]
    except ValueError:
        print(f"ckpt_scale: --arrays {args.arrays!r} / --ranks {args.ranks!r}: use comma-separated integers",
              file=sys.stderr)
        return 2
    if any(n < 1 for n in array_sizes + rank_sizes):
        print("ckpt_scale: --arrays and --ranks sizes must be >= 1", file=sys.stderr)
        return 2
    store_kwargs = {} if args.gather else {"gather_small_bytes": 0}
    root = Path(args.dir or tempfile.mkdtemp(prefix="marind-ckpt-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result: dict = {"bench": "ckpt_scale", "quick": args.quick, "repeats": repeats, "store_options": store_kwargs,
                    "array_shape": [rows, cols], "dtype": "float32"}
    try:
        result["arrays_sweep"] = {"world": args.arrays_world, "points": sweep(
            root, "arrays", array_sizes, args.arrays_world, rows, cols, repeats, store_kwargs, 3000)}
        result["ranks_sweep"] = {"arrays": ranks_arrays, "points": sweep(
            root, "ranks", rank_sizes, ranks_arrays, rows, cols, repeats, store_kwargs, 3000)}
        result["seconds"] = round(time.monotonic() - started, 1)
        result["exponents"] = {"arrays": exponents(result["arrays_sweep"]["points"], "arrays"),
                               "ranks": exponents(result["ranks_sweep"]["points"], "world")}
        result["floor_save_exponent_le_1_1"] = {
            k: (e["marind_save_s"] <= 1.1 if e["marind_save_s"] is not None else None)
            for k, e in result["exponents"].items()}
    finally:
        kill_all()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()       # its servers, ranks and bed are undone (finally) on SIGTERM too
    sys.exit(main())

"""`marind ckpt ls | inspect | verify | export URL` — a thin layer over ckpt_store.

s3:// URLs take credentials and endpoint from the environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, MARIND_S3_ENDPOINT or AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="list, inspect, verify and export checkpoints")
    cs = ckpt.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", parser_class=type(ckpt))
    p = cs.add_parser("ls", help="committed steps under URL")
    p.add_argument("url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=ls)
    p = cs.add_parser("inspect", help="arrays, shapes, dtypes, sizes and saved layout of a step")
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the latest committed step")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=inspect)
    p = cs.add_parser("verify", help="re-read every object of a step; exit 1 on any problem")
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the latest committed step")
    p.set_defaults(handler=verify)
    p = cs.add_parser("export", help="consolidate a step into one safetensors file")
    p.add_argument("url")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--group", default="model", help="arrays under this group (default model; '' = all)")
    p.add_argument("out")
    p.set_defaults(handler=export)
    ckpt.set_defaults(handler=lambda args: (ckpt.print_help(sys.stderr), 2)[1])


def _store(url: str):
    from ckpt_store import CheckpointStore
    from ckpt_store.export import env_storage_options

    return CheckpointStore(url, storage_options=env_storage_options(url))


def _step(store, step: int | None) -> int:
    from ckpt_store import CheckpointNotFound

    if step is None:
        step = store.latest()
        if step is None:
            raise CheckpointNotFound(f"no committed checkpoint under {store.url}")
    return step


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ls(args) -> int:
    store = _store(args.url)
    rows = []
    for step in store.steps():
        m = store.manifest(step)
        rows.append({"step": step, "arrays": len(m["arrays"]), "objects": len(m["objects"]),
                     "bytes": sum(int(o["size"]) for o in m["objects"].values()),
                     "world_size": m.get("world", {}).get("world_size"), "created_at": m.get("created_at")})
    if args.json:
        print(json.dumps({"url": args.url, "steps": rows}))
        return 0
    if not rows:
        print(f"No checkpoints under {args.url}.")
        return 0
    print(f"{'STEP':>10}  {'ARRAYS':>6}  {'OBJECTS':>7}  {'SIZE':>10}  {'WORLD':>5}  CREATED")
    for r in rows:
        print(f"{r['step']:>10}  {r['arrays']:>6}  {r['objects']:>7}  {_size(r['bytes']):>10}  "
              f"{r['world_size'] or '?':>5}  {r['created_at'] or ''}")
    return 0


def inspect(args) -> int:
    from ckpt_store.zarr_format import TORCH_DTYPES

    store = _store(args.url)
    step = _step(store, args.step)
    m = store.manifest(step)
    arrays = []
    for name, a in sorted(m["arrays"].items()):
        itemsize = TORCH_DTYPES[a["dtype"]].itemsize
        n = 1
        for s in a["shape"]:
            n *= s
        arrays.append({"name": name, "shape": a["shape"], "dtype": a["dtype"], "bytes": n * itemsize,
                       "chunks": a["chunks"], "layout": a.get("layout")})
    if args.json:
        print(json.dumps({"step": step, "world": m.get("world"), "arrays": arrays}))
        return 0
    print(f"step {step}  saved by {m.get('world', {}).get('world_size')} rank(s) at {m.get('created_at')}")
    for a in arrays:
        lay = a["layout"] or {}
        how = "replicated" if lay.get("replicated") else f"mesh {lay.get('mesh_shape')} {lay.get('placements')}"
        print(f"  {a['name']:<48} {str(a['shape']):<16} {a['dtype']:<9} {_size(a['bytes']):>10}  {how}")
    return 0


def verify(args) -> int:
    store = _store(args.url)
    step = _step(store, args.step)
    report = store.verify(step)
    for p in report.problems:
        print(f"PROBLEM {p}")
    state = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    print(f"step {step}: {state}, {report.objects} objects, {_size(report.bytes)} re-read")
    return 0 if report.ok else 1


def export(args) -> int:
    from ckpt_store.export import export_safetensors

    store = _store(args.url)
    tty = sys.stderr.isatty()

    def progress(i: int, n: int, nbytes: int) -> None:
        if tty:
            bar = "#" * int(30 * i / n)
            sys.stderr.write(f"\rexport [{bar:<30}] {i}/{n} arrays {_size(nbytes)}")
            if i == n:
                sys.stderr.write("\n")
            sys.stderr.flush()

    out = export_safetensors(store, args.step, args.out, group=args.group, progress=progress)
    print(f"wrote {args.out}: {out['tensors']} tensors, {_size(out['bytes'])} from step {args.step}")
    return 0

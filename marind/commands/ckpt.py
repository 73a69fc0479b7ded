"""`marind ckpt ls | inspect | verify | export URL` — a thin layer over ckpt_store.

``export --format hf`` maps a trainer checkpoint to a Hugging Face Llama directory
(``marind.trainer.hf.export``; ckpt_store stays model-agnostic).

s3:// URLs take credentials and endpoint from the environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, MARIND_S3_ENDPOINT or AWS_ENDPOINT_URL).
Storage that cannot be reached fails with one line naming the endpoint and the
fix (exit 1); refused credentials, or a URL that is a file, exit 2.
"""

from __future__ import annotations

import functools
import json
import sys

from ckpt_store.errors import CheckpointError
from marind.core.errors import MarindError, UsageError


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="list, inspect, verify and export checkpoints")
    cs = ckpt.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", parser_class=type(ckpt))
    p = cs.add_parser("ls", help="committed steps under URL; exit 1 if any step's manifest is unreadable",
                      description="List every committed step under URL. A step whose manifest cannot be "
                                  "read is listed as CORRUPT (or UNSUPPORTED: written by a newer marind) "
                                  "with the reason, and the command then exits 1.")
    p.add_argument("url")
    p.add_argument("--json", action="store_true",
                   help='{"url", "steps": [{"step", "arrays", "objects", "bytes", "world_size", '
                        '"created_at", "error"}]}; "error" is null for a readable step')
    p.set_defaults(handler=_guard(ls))
    p = cs.add_parser("inspect", help="arrays, shapes, dtypes, sizes and saved layout of a step")
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the latest committed step that reads clean")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_guard(inspect))
    p = cs.add_parser("verify", help="re-read every object of a step; exit 1 on any problem")
    p.add_argument("url")
    p.add_argument("--step", type=int, help="default: the newest committed step (corrupt or not)")
    p.set_defaults(handler=_guard(verify))
    p = cs.add_parser("export", help="consolidate a step into one safetensors file, or a Hugging Face directory",
                      description="--format safetensors: one file OUT with the arrays under --group. "
                                  "--format hf: a directory OUT that transformers loads with "
                                  "AutoModelForCausalLM.from_pretrained (a trainer checkpoint as Llama: "
                                  "config.json, sharded safetensors and their index).")
    p.add_argument("url")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors")
    p.add_argument("--group", default="model", help="safetensors: arrays under this group (default model; '' = all)")
    p.add_argument("--max-shard-size", default="2GB",
                   help="hf: the largest safetensors shard (default 2GB; e.g. 500MB, 64MiB)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="hf: the weights' dtype (default auto: as saved); e.g. bfloat16 halves an fp32 run's export")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="hf: copy this tokenizer.json (the data's, `data prepare --tokenizer`) into OUT")
    p.add_argument("--config", metavar="RUN_TOML",
                   help="hf: the run's spec, for a checkpoint that does not record its model config")
    p.add_argument("out", help="safetensors: the file; hf: the directory to create (new or empty)")
    p.set_defaults(handler=_guard(export))
    ckpt.set_defaults(handler=lambda args: (ckpt.print_help(sys.stderr), 2)[1])


def _store(url: str):
    from ckpt_store import CheckpointStore
    from ckpt_store.export import env_s3_endpoint, env_storage_options

    store = CheckpointStore(url, storage_options=env_storage_options(url))
    if store.storage.s3:   # a mistyped bucket is an error, not an empty store
        bucket = store.storage.root.split("/", 1)[0]
        try:
            store.storage.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            endpoint = env_s3_endpoint() or "AWS S3"
            raise UsageError(f"no S3 bucket {bucket!r} at {endpoint}: check the URL "
                             "(s3://BUCKET/PREFIX)") from None
    return store


def _guard(handler):
    """Run ``handler``, turning storage failures into one-line errors that name the fix."""
    @functools.wraps(handler)
    def run(args) -> int:
        try:
            return handler(args)
        except (MarindError, CheckpointError):
            raise       # already one line naming the problem
        except Exception as exc:
            mapped = _storage_error(args.url, exc)
            if mapped is None:
                raise
            raise mapped from exc
    return run


def _storage_error(url: str, exc: BaseException) -> Exception | None:
    """A one-line error with its fix for a storage failure (None: not one this knows)."""
    from ckpt_store.errors import CheckpointStorageUnavailable
    from ckpt_store.export import env_s3_endpoint

    try:
        import aiohttp
        import botocore.exceptions as boto
        unreachable: tuple = (ConnectionError, boto.ConnectionError, aiohttp.ClientConnectionError)
        no_creds: tuple = (boto.NoCredentialsError, boto.PartialCredentialsError)
    except ImportError:    # no s3fs stack installed: only local stores
        unreachable, no_creds = (ConnectionError,), ()
    s3 = url.startswith(("s3://", "s3a://"))
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:   # the library may have wrapped it
        if isinstance(cause, no_creds):
            return UsageError(f"no S3 credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if s3 and isinstance(cause, unreachable):
            endpoint = env_s3_endpoint()
            where = f"S3 endpoint {endpoint}" if endpoint else "the default AWS S3 endpoint"
            return CheckpointStorageUnavailable(
                f"cannot reach {where} for {url} (check MARIND_S3_ENDPOINT / AWS_ENDPOINT_URL "
                "and that the server is up)")
        if s3 and isinstance(cause, PermissionError):
            return UsageError(f"S3 refused access to {url} ({cause}): check AWS_ACCESS_KEY_ID / "
                              "AWS_SECRET_ACCESS_KEY and the bucket's permissions")
        if isinstance(cause, NotADirectoryError):
            return UsageError(f"checkpoint URL {url} is a file, not a directory: pass the store's "
                              "root directory (the one holding step-* directories)")
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


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


def _newest(store, step: int | None) -> int:
    """``step``, or the newest committed step (one with a manifest), readable or not."""
    from ckpt_store import CheckpointNotFound

    if step is not None:
        return step
    steps = store.steps()
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint under {store.url}")
    return steps[-1]


def ls(args) -> int:
    from ckpt_store import CheckpointCorrupt, CheckpointError, CheckpointNotFound
    from ckpt_store.errors import CheckpointFormatUnsupported

    store = _store(args.url)
    if not store.storage.s3 and not store.storage.fs.exists(store.storage.root):
        raise CheckpointNotFound(f"no checkpoint store at {args.url}: {store.storage.root} does not exist "
                                 "(check the URL; a store's root holds step-* directories)")
    rows, bad = [], []
    for step in store.steps():
        try:
            m = store.manifest(step)
        except CheckpointNotFound:
            continue    # deleted (retention) since the listing
        except CheckpointError as exc:
            mark = "UNSUPPORTED" if isinstance(exc, CheckpointFormatUnsupported) else "CORRUPT"
            reason = exc.reason if isinstance(exc, CheckpointCorrupt) else str(exc)
            rows.append({"step": step, "arrays": None, "objects": None, "bytes": None,
                         "world_size": None, "created_at": None, "error": f"{mark}: {reason}"})
            bad.append(step)
            continue
        rows.append({"step": step, "arrays": len(m["arrays"]), "objects": len(m["objects"]),
                     "bytes": sum(int(o["size"]) for o in m["objects"].values()),
                     "world_size": m.get("world", {}).get("world_size"), "created_at": m.get("created_at"),
                     "error": None})
    if args.json:
        print(json.dumps({"url": args.url, "steps": rows}))
    elif not rows:
        print(f"No checkpoints under {args.url}.")
    else:
        print(f"{'STEP':>10}  {'ARRAYS':>6}  {'OBJECTS':>7}  {'SIZE':>10}  {'WORLD':>5}  CREATED")
        for r in rows:
            if r["error"]:
                print(f"{r['step']:>10}  {r['error']}")
                continue
            print(f"{r['step']:>10}  {r['arrays']:>6}  {r['objects']:>7}  {_size(r['bytes']):>10}  "
                  f"{r['world_size'] or '?':>5}  {r['created_at'] or ''}")
    if bad:
        sys.stderr.write(f"Error: {len(bad)} of {len(rows)} steps cannot be read (steps {bad}); "
                         f"see `marind ckpt verify {args.url} --step {bad[-1]}`\n")
        return 1
    return 0


def inspect(args) -> int:
    from ckpt_store.export import TORCH_DTYPES

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
    step = _newest(store, args.step)
    report = store.verify(step)
    for p in report.problems:
        print(f"PROBLEM {p}")
    state = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    print(f"step {step}: {state}, {report.objects} objects, {_size(report.bytes)} re-read")
    return 0 if report.ok else 1


def export(args) -> int:
    from ckpt_store.export import export_safetensors

    store = _store(args.url)
    progress = _progress(sys.stderr.isatty())
    if args.format == "hf":
        return _export_hf(args, store, progress)
    if args.tokenizer:
        raise UsageError("--tokenizer applies to --format hf only; leave it out for --format safetensors")
    if args.dtype != "auto":
        raise UsageError(f"--dtype {args.dtype} applies to --format hf only; leave it out for --format safetensors")
    out = export_safetensors(store, args.step, args.out, group=args.group, progress=progress)
    print(f"wrote {args.out}: {out['tensors']} tensors, {_size(out['bytes'])} from step {args.step}")
    return 0


def _export_hf(args, store, progress) -> int:
    from ckpt_store.export import parse_size
    from marind.trainer.hf.export import export_hf

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    try:
        out = export_hf(store, args.step, args.out, config_path=args.config, max_shard_bytes=max_bytes,
                        dtype=None if args.dtype == "auto" else args.dtype, tokenizer=args.tokenizer,
                        progress=progress)
    except ValueError as exc:     # a bad OUT, no model config, arrays that are not the trainer's GPT
        raise UsageError(str(exc)) from None
    print(f"wrote {args.out}: {out['tensors']} tensors in {out['shards']} shard(s), {_size(out['bytes'])} "
          f"from step {args.step} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def _progress(tty: bool):
    """A progress callback: a bar on a TTY, else a line at every tenth of the arrays."""
    shown = [-1]

    def progress(i: int, n: int, nbytes: int) -> None:
        if tty:
            bar = "#" * int(30 * i / n)
            sys.stderr.write(f"\rexport [{bar:<30}] {i}/{n} arrays {_size(nbytes)}")
            if i == n:
                sys.stderr.write("\n")
        elif 10 * i // n > shown[0]:
            shown[0] = 10 * i // n
            sys.stderr.write(f"export: {i}/{n} arrays, {_size(nbytes)} written\n")
        sys.stderr.flush()
    return progress

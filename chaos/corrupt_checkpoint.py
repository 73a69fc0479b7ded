"""Corrupt one object of the newest committed checkpoint: bit rot, a torn write.

    python chaos/corrupt_checkpoint.py [--job JOB] [--url CKPT_URL] [--step S]
        [--mode flip|truncate] [--object KEY | --within PREFIX [--chunks-only]] [--bytes 8] [--seed N]
        [--storage-options JSON]

The checkpoint is ``--step`` or the newest committed one (its
``manifest.json`` exists) under ``--url`` (default: the job spec's
``checkpoint.url``). The object is ``--object`` or a seeded choice among
the manifest's non-empty objects (``--chunks-only``: among the array chunks, the
data a load reads; the arrays' ``zarr.json`` files are for other Zarr readers,
marind's loader goes by the manifest). ``flip`` inverts ``--bytes`` bytes at
seeded offsets (size unchanged, so only a checksum notices); ``truncate``
cuts the object to half its size. The manifest itself is left alone, so
the step still looks committed. One ``corrupt`` line; exit 0 if an object
was corrupted, 1 if there was no committed checkpoint.
"""

from __future__ import annotations

import sys

from marind.testing.chaos.ckpt import add_root_args, committed_steps, read_manifest, resolve_root, step_dir_name
from marind.testing.chaos.common import NothingToDo, base_parser, connect, emit, run, seeded_rng


def choose_object(objects: dict, rng, key: str | None, within: str = "", chunks_only: bool = False) -> str:
    """The object to corrupt: ``key`` if given (must be in the manifest), else a seeded choice
    among the non-empty objects whose key starts with ``within`` (``chunks_only``: that hold array
    chunks, those the manifest gives a ``chunks_crc32c``)."""
    if key is not None:
        if key not in objects:
            raise ValueError(f"--object {key!r} is not in the manifest (it lists {len(objects)} objects)")
        return key
    candidates = sorted(k for k, v in objects.items()
                        if k.startswith(within) and int((v or {}).get("size", 0)) > 0
                        and (not chunks_only or "chunks_crc32c" in (v or {})))
    if not candidates:
        raise NothingToDo(f"the manifest lists no non-empty object under {within!r}")
    return rng.choice(candidates)


def corrupt_bytes(data: bytes, mode: str, rng, nbytes: int) -> tuple[bytes, dict]:
    """The corrupted content and what was done to it (pure apart from ``rng``)."""
    if mode == "truncate":
        cut = len(data) // 2
        return data[:cut], {"from_size": len(data), "to_size": cut}
    offsets = sorted(rng.sample(range(len(data)), min(nbytes, len(data))))
    out = bytearray(data)
    for off in offsets:
        out[off] ^= 0xFF
    return bytes(out), {"offsets": offsets}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n", 1)[0], job_required=False)
    add_root_args(parser)
    parser.add_argument("--step", type=int, help="corrupt this committed step (default: the newest)")
    parser.add_argument("--mode", choices=("flip", "truncate"), default="flip")
    parser.add_argument("--object", help="manifest key of the object to corrupt")
    parser.add_argument("--within", default="", help="choose among objects whose key starts with "
                                                    "this, e.g. model/ (default: any)")
    parser.add_argument("--chunks-only", action="store_true",
                        help="choose among the array chunks only (the data a load reads)")
    parser.add_argument("--bytes", type=int, default=8, help="bytes to flip (mode flip)")
    args = parser.parse_args(argv)
    if args.bytes < 1:
        raise ValueError("--bytes must be >= 1")
    rng = seeded_rng(args)
    fs, root, url = resolve_root(args, connect(args) if args.job and not args.url else None)
    steps = committed_steps(fs, root)
    if args.step is not None and args.step not in steps:
        raise NothingToDo(f"step {args.step} is not a committed checkpoint under {url}")
    if not steps:
        raise NothingToDo(f"no committed checkpoint under {url}")
    step = args.step if args.step is not None else steps[-1]
    manifest = read_manifest(fs, root, step)
    key = choose_object(manifest.get("objects") or {}, rng, args.object, args.within, args.chunks_only)
    path = f"{root}/{step_dir_name(step)}/{key}"
    data = fs.cat_file(path)
    bad, detail = corrupt_bytes(data, args.mode, rng, args.bytes)
    fs.pipe_file(path, bad)
    emit("corrupt", target=f"{url.rstrip('/')}/{step_dir_name(step)}/{key}", step=step, key=key,
         mode=args.mode, job=args.job, seed=args.seed, **detail)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

"""Reading a checkpoint root the way docs/design.md §4 lays it out, without ckpt_store.

``{url}/step-{step:010d}/`` holds a checkpoint; it is committed once its
``manifest.json`` (``{format, step, arrays, objects: {key: {size, crc32c}}, world}``;
format 2 adds ``parts``, the ranks' object lists, whose objects count as listed)
exists. The injectors read this layout directly so that they keep working
(and can corrupt things) whatever state ckpt_store's own code is in.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import fsspec

from marind.testing.chaos.common import NothingToDo, wait_until

STEP_DIR = re.compile(r"^step-(\d{10})$")
MANIFEST = "manifest.json"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-NNNNNNNNNN`` directory name or path; None for any other name."""
    match = STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def step_dir_name(step: int) -> str:
    """``step-{step:010d}``: the directory of a step's checkpoint."""
    return f"step-{step:010d}"


def storage_options(url: str, given: str | None, s3_endpoint: str | None = None) -> dict:
    """``--storage-options`` JSON (else ``$MARIND_STORAGE_OPTIONS``), plus an S3 endpoint."""
    text = given or os.environ.get("MARIND_STORAGE_OPTIONS")
    try:
        opts = json.loads(text) if text else {}
    except ValueError as exc:
        raise ValueError(f"--storage-options is not JSON: {exc}") from None
    if url.startswith("s3://") and s3_endpoint:
        opts.setdefault("client_kwargs", {}).setdefault("endpoint_url", s3_endpoint)
    return opts


def open_root(url: str, options: dict):
    """(filesystem, root path) for a checkpoint url; the filesystem never serves a stale listing."""
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    return fs, root.rstrip("/")


def step_dirs(fs, root: str) -> dict[int, str]:
    """{step: path} of every step directory, committed or not."""
    fs.invalidate_cache()
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        step = parse_step_dir(name)
        if step is not None:
            out[step] = name.rstrip("/")
    return out


def is_committed(fs, step_path: str) -> bool:
    """Whether the step directory holds its ``manifest.json`` (written last, at commit)."""
    return fs.exists(f"{step_path}/{MANIFEST}")


def committed_steps(fs, root: str) -> list[int]:
    """The committed steps under ``root``, ascending."""
    dirs = step_dirs(fs, root)
    return sorted(s for s, path in dirs.items() if is_committed(fs, path))


def read_manifest(fs, root: str, step: int) -> dict:
    """A committed step's ``manifest.json``, parsed; format 2's per-rank object lists
    (``parts``) merged into ``objects``, as format 1 has them."""
    with fs.open(f"{root}/{step_dir_name(step)}/{MANIFEST}", "rb") as fh:
        manifest = json.loads(fh.read())
    for part in manifest.get("parts") or []:
        with fs.open(f"{root}/{step_dir_name(step)}/{part['key']}", "rb") as fh:
            manifest["objects"].update(json.loads(fh.read())["objects"])
    return manifest


def uncommitted_above(dirs: dict[int, str], committed: set[int]) -> set[int]:
    """Steps with a directory but no manifest, newer than the newest committed one (pure)."""
    newest = max(committed) if committed else -1
    return {s for s in dirs if s > newest and s not in committed}


class SaveWatcher:
    """Notices a checkpoint save that starts after it was created.

    ``poll()`` returns the step of a step directory without a manifest,
    newer than every committed step, that was not there at the first
    poll (leftovers of an old failed save are not a save in progress).
    """

    def __init__(self, fs, root: str):
        self.fs, self.root = fs, root
        self.committed: set[int] = set()
        self.baseline: set[int] | None = None

    def poll(self) -> int | None:
        """The step of a save begun since the first poll, or None (the first poll only takes the baseline)."""
        dirs = step_dirs(self.fs, self.root)
        for step, path in dirs.items():
            if step not in self.committed and is_committed(self.fs, path):
                self.committed.add(step)
        pending = uncommitted_above(dirs, self.committed)
        if self.baseline is None:
            self.baseline = pending
            return None
        fresh = pending - self.baseline
        return max(fresh) if fresh else None


def _job_spec(client, job: str) -> dict:
    spec = client.get_json(client.key("jobs", job, "spec")) or {}
    if not isinstance(spec, dict):
        return {}
    return spec["spec"] if "checkpoint" not in spec and isinstance(spec.get("spec"), dict) else spec


def checkpoint_url_of_job(client, job: str) -> str | None:
    """The job spec's checkpoint url (``spec.checkpoint.url``), if any."""
    ckpt = _job_spec(client, job).get("checkpoint")
    return ckpt.get("url") if isinstance(ckpt, dict) else None


def job_s3_env(client, job: str) -> dict:
    """The S3 settings the job's workers get from ``[job.env]`` (endpoint, keys), as storage options."""
    env = (_job_spec(client, job).get("job") or {}).get("env") or {}
    opts: dict = {}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        opts.update(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"])
    if env.get("AWS_ENDPOINT_URL"):
        opts["client_kwargs"] = {"endpoint_url": env["AWS_ENDPOINT_URL"]}
    return opts


def add_root_args(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--storage-options``, ``--s3-endpoint``: which checkpoint root, and how to reach it."""
    parser.add_argument("--url", help="checkpoint root url (default: the job spec's checkpoint.url)")
    parser.add_argument("--storage-options", help="fsspec storage options as JSON "
                                                  "(default $MARIND_STORAGE_OPTIONS, then the S3 "
                                                  "settings of the job's [job.env])")
    parser.add_argument("--s3-endpoint", help="S3 endpoint url, added to the storage options")


def resolve_root(args, client, s3_endpoint: str | None = None):
    """(filesystem, root, url) of the checkpoint root that ``add_root_args``' flags name.

    The url is ``--url``, else the job spec's; storage options are
    ``--storage-options`` (or ``$MARIND_STORAGE_OPTIONS``), else what the
    job's workers are given in ``[job.env]``; ``--s3-endpoint`` (or
    ``s3_endpoint``) is added to them.
    """
    url = args.url
    if not url:
        if not getattr(args, "job", None):
            raise ValueError("name the checkpoint: pass --url or --job")
        url = checkpoint_url_of_job(client, args.job)
        if not url:
            raise NothingToDo(f"job {args.job} has no checkpoint url in its spec")
    opts = storage_options(url, args.storage_options, args.s3_endpoint or s3_endpoint)
    if url.startswith("s3://") and not (args.storage_options or os.environ.get("MARIND_STORAGE_OPTIONS")) \
            and client is not None and getattr(args, "job", None):
        for key, value in job_s3_env(client, args.job).items():
            opts.setdefault(key, value)
    fs, root = open_root(url, opts)
    return fs, root, url


def add_save_wait_args(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--during-save``: act once a new checkpoint save is seen in progress."""
    parser.add_argument("--during-save", action="store_true",
                        help=f"{what} the moment a new checkpoint save is seen in progress")


def wait_for_save(fs, root: str, url: str, timeout: float, log) -> int:
    """The step of a checkpoint save that starts within ``timeout`` seconds, else NothingToDo.

    ``waiting_for_save`` is logged once the saves already under way are known.
    """
    watcher = SaveWatcher(fs, root)
    watcher.poll()
    log.info("waiting_for_save", url=url, timeout=timeout)
    step = wait_until(watcher.poll, timeout=timeout, interval=0.05)
    if step is None:
        raise NothingToDo(f"no checkpoint save started under {url} within {timeout:g}s")
    return step

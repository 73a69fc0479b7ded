"""Consolidate one committed step into a single safetensors file (for inference tools)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ckpt_store.export.sharded import read_array
from ckpt_store.log import get_logger

log = get_logger(__name__)


def env_s3_endpoint() -> str | None:
    """The S3 endpoint the environment names: MARIND_S3_ENDPOINT, else AWS_ENDPOINT_URL."""
    return os.environ.get("MARIND_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")


def env_storage_options(url: str) -> dict | None:
    """s3fs options from the environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, and the
    endpoint from MARIND_S3_ENDPOINT or AWS_ENDPOINT_URL (None for non-s3 URLs)."""
    if not url.startswith("s3://"):
        return None
    opts: dict = {}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        opts["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        opts["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    endpoint = env_s3_endpoint()
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint,
                                 "region_name": os.environ.get("AWS_REGION", "us-east-1")}
    return opts


def export_safetensors(store, step: int, out: str, group: str = "model",
                       progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Write arrays under ``group`` (all if "") to ``out``; names drop the ``group/`` prefix
    and join the rest with "." (``model/layers/0/w`` -> ``layers.0.w``).

    ``out`` is checked before anything is read, and two arrays that would get the
    same name fail the export before anything is written (ValueError). Arrays are
    read one at a time through ``store.load_arrays`` (checksums checked; no collectives); the file is
    written under a temporary name, renamed into place, and the temporary file
    removed on any failure. Returns {"tensors": n, "bytes": total}.
    """
    from safetensors.torch import save_file

    check_output(out)
    manifest = store.manifest(step)
    prefix = f"{group}/" if group else ""
    names = sorted(n for n in manifest["arrays"] if n.startswith(prefix))
    if not names:
        raise ValueError(f"step {step} has no arrays under {group!r}; pass --group '' to export all")
    keys = export_names(names, prefix)
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    for i, name in enumerate(names, 1):
        t = read_array(store, step, name, manifest["arrays"][name])
        tensors[keys[name]] = t
        total += t.numel() * t.element_size()
        if progress:
            progress(i, len(names), total)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata={"marind_step": str(step), "marind_url": store.url})
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    log.info("ckpt_exported", step=step, out=out, tensors=len(tensors), bytes=total)
    return {"tensors": len(tensors), "bytes": total}


def export_names(names: list[str], prefix: str) -> dict[str, str]:
    """Array name -> safetensors name; ValueError naming both arrays when two would collide."""
    keys: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        key = name[len(prefix):].replace("/", ".")
        if key in seen:
            raise ValueError(f"arrays {seen[key]!r} and {name!r} would both be exported as {key!r}; "
                             f"export one on its own (--group {name.rsplit('/', 1)[0]!r}) "
                             "or rename one of them in the training state")
        seen[key] = name
        keys[name] = key
    return keys


def check_output(out: str) -> None:
    """Refuse an ``out`` that cannot take the file (ValueError naming it and the fix)."""
    path = os.path.abspath(out)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        example = os.path.join(out, "model.safetensors")
        raise ValueError(f"output {out} is a directory; pass a file name, e.g. {example}")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"output directory {parent} {what}; create it or pass another output path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output directory {parent} is not writable; pass an output path in a "
                         "directory you can write")

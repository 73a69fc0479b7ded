"""Consolidate one committed step into a single safetensors file (for inference tools)."""

from __future__ import annotations

import os
from typing import Callable

import torch

from ckpt_store.zarr_format import TORCH_DTYPES


def env_storage_options(url: str) -> dict | None:
    """s3fs options from the environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, and the
    endpoint from MARIND_S3_ENDPOINT or AWS_ENDPOINT_URL (None for non-s3 URLs)."""
    if not url.startswith("s3://"):
        return None
    opts: dict = {}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        opts["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        opts["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    endpoint = os.environ.get("MARIND_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint,
                                 "region_name": os.environ.get("AWS_REGION", "us-east-1")}
    return opts


def export_safetensors(store, step: int, out: str, group: str = "model",
                       progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Write arrays under ``group`` (all if "") to ``out``; names drop the ``group/`` prefix.

    Arrays are read one at a time through ``store.load`` (checksums checked);
    returns {"tensors": n, "bytes": total}.
    """
    from safetensors.torch import save_file

    manifest = store.manifest(step)
    prefix = f"{group}/" if group else ""
    names = sorted(n for n in manifest["arrays"] if n.startswith(prefix))
    if not names:
        raise ValueError(f"step {step} has no arrays under {group!r}; pass --group '' to export all")
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    for i, name in enumerate(names, 1):
        meta = manifest["arrays"][name]
        t = torch.empty(tuple(meta["shape"]), dtype=TORCH_DTYPES[meta["dtype"]])
        state: dict = {}
        node = state
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t
        store.load_arrays(state, step)
        key = name[len(prefix):].replace("/", ".")
        tensors[key] = t
        total += t.numel() * t.element_size()
        if progress:
            progress(i, len(names), total)
    tmp = f"{out}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"marind_step": str(step), "marind_url": store.url})
    os.replace(tmp, out)
    return {"tensors": len(tensors), "bytes": total}

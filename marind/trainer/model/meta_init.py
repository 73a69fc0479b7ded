"""Initial weights that do not depend on the layout: one seeded generator per parameter.

The model is built on the ``meta`` device (no memory), parallelized (TP, FSDP2), then
materialized with ``to_empty`` (each rank allocates its own shards only) and filled here:
each parameter's *global* tensor is drawn from a CPU generator seeded by (``train.seed``,
the parameter's FQN) and this rank keeps its shard of it (``distribute_tensor`` with
``src_data_rank=None``: a local split, no communication). So 1 rank, FSDP, TP and HSDP start
from bit-identical global weights. One parameter's full tensor exists at a time: the setup's
peak memory is the rank's shards plus the largest parameter, not the model.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

#: prefixes that wrappers add to parameter names (activation checkpointing, torch.compile)
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's FQN without the wrappers' parts (the checkpoint's name)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def param_seed(seed: int, fqn: str) -> int:
    """The generator seed of parameter ``fqn`` in a run seeded ``seed`` (63 bits of a SHA-256)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(fqn: str, shape: tuple[int, ...], *, n_layers: int, seed: int) -> torch.Tensor:
    """The global initial tensor of parameter ``fqn`` (float32, CPU), a pure function of its arguments.

    Norm weights (1-D) are ones; the attention, MLP and expert output projections are
    normal(0, 0.02 / sqrt(2 n_layers)); every other matrix is normal(0, 0.02).

    Args:
        fqn: the parameter's canonical name (``layers.0.attention.wq.weight``).
        shape: its global shape.
        n_layers: the model's depth (scales the output projections).
        seed: the run's seed (``train.seed``).

    Returns:
        The tensor.
    """
    if len(shape) == 1:
        return torch.ones(shape)
    std = 0.02
    if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared.w2.weight")):
        std = std / math.sqrt(2 * n_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, fqn))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model: nn.Module, *, n_layers: int, seed: int) -> int:
    """Fill every parameter of ``model`` (plain or DTensor, materialized) with :func:`initial_value`.

    Not collective: each rank splits the global tensor locally.

    Args:
        model: the materialized model (after ``to_empty``).
        n_layers: the model's depth.
        seed: the run's seed.

    Returns:
        The largest parameter's element count (what one full tensor at a time costs).
    """
    largest = 0
    for name, p in model.named_parameters():
        full = initial_value(canonical_name(name), tuple(p.shape), n_layers=n_layers, seed=seed).to(p.dtype)
        largest = max(largest, full.numel())
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
        del full
    return largest

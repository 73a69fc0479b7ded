"""Mesh and parallelism: DeviceMesh (dp_replicate, dp_shard, tp), TP plan, FSDP2, AC, compile.

Order, as FSDP2 + TP expect: tensor-parallel plan on each block, then
activation checkpointing and ``torch.compile`` per block, then
``fully_shard`` per block and at the root over the data-parallel mesh
(``dp_shard``, or ``(dp_replicate, dp_shard)`` = HSDP). FSDP is applied at
every size, even 1, so that every parameter is a DTensor and checkpoints
look the same whatever the layout. Embeddings, norms and the LM head stay
replicated over ``tp`` (sharded over dp only). Mixture-of-experts blocks: their experts
are sharded over ``ep`` and FSDP over the rest of ``dp_shard`` (``marind.trainer.parallel.expert``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from marind.trainer.config import TrainerSpec, validate_for_world
from marind.trainer.model.gpt import GPT
from marind.trainer.parallel.expert import parallelize_experts, tp_plan_for
from marind.trainer.parallel.grad_norm import clip_grad_norm

__all__ = ["MESH_DIMS", "Layout", "build_mesh", "clip_grad_norm", "parallelize", "tp_plan"]

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: mesh sizes and its data-parallel coordinates."""

    dp_replicate: int
    dp_shard: int
    tp: int
    dp_rank: int
    pp: int = 1
    ep: int = 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, int]:
        """The mesh sizes, as checkpoints record them."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp,
                "ep": self.ep}


def build_mesh(spec: TrainerSpec, world_size: int, device_type: str) -> tuple[DeviceMesh, Layout]:
    """The (dp_replicate, dp_shard, tp) device mesh of this world and this rank's place in it.

    Args:
        spec: the run's spec (``[parallel]``).
        world_size: ranks in the world.
        device_type: ``"cuda"`` or ``"cpu"``.

    Returns:
        (mesh, layout).

    Raises:
        SpecError: the parallel layout does not fit ``world_size``.
    """
    sizes = validate_for_world(spec, world_size)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    dr, ds, _ = sizes
    dp_rank = mesh.get_local_rank("dp_replicate") * ds + mesh.get_local_rank("dp_shard")
    return mesh, Layout(*sizes, dp_rank=dp_rank, ep=spec.parallel.ep)


def tp_plan() -> dict[str, ParallelStyle]:
    """Tensor-parallel plan of one transformer block (column-wise in, row-wise out)."""
    return {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def parallelize(model: GPT, mesh: DeviceMesh, spec: TrainerSpec) -> GPT:
    """Apply TP, activation checkpointing, ``torch.compile`` and FSDP2 to ``model`` in place.

    Args:
        model: the freshly built model.
        mesh: the mesh of :func:`build_mesh`.
        spec: the run's spec (``[parallel]``).

    Returns:
        ``model``.
    """
    p = spec.parallel
    blocks = list(model.layers.named_children())   # a ModuleList, or a pipeline stage's ModuleDict
    if mesh["tp"].size() > 1:
        for _, block in blocks:
            parallelize_module(block, mesh["tp"], tp_plan_for(block, tp_plan()))
    if p.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for name, block in blocks:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        blocks = list(model.layers.named_children())
    if p.compile:
        for _, block in blocks:
            block.compile()
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if p.mixed_precision == "bf16" else MixedPrecisionPolicy()
    parallelize_experts(model, mesh, ep=p.ep, mp_policy=mp, dp_size=dp_mesh.size())
    n = len(blocks)
    for i, (_, block) in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model

"""Global gradient norm with one all-reduce per device mesh, and clipping by it.

Every DTensor gradient is sharded over some mesh dimensions and replicated over the others
(FSDP: ``Shard(0)`` over ``dp_shard``; HSDP: ``(Replicate, Shard(0))`` over ``(dp_replicate,
dp_shard)``; TP x FSDP: a shard over both). Each rank sums the squares of its local shards,
grouped by (mesh, placements); a rank *contributes* a group's sum only where its coordinate
on every replicated dimension is 0, so that summing over the whole mesh counts each element
exactly once (adding zeros is exact). The groups of one mesh then share one all-reduce over
all of that mesh's ranks; a mesh of one rank needs none. :func:`reduction_plan` is that
accounting as a pure function, unit-tested without processes.

Under pipeline parallelism (``pp_mesh``: the world mesh with an outer ``pp`` dimension) each
stage holds other parameters on its own meshes, all with the same dimension names. The
all-reduce of a mesh then runs over that mesh *and* ``pp`` at once (the world mesh's slice
``("pp", *names)``), so the sum covers every stage and it is still one all-reduce per mesh,
issued in the order of the meshes' names on every rank (every stage has the same kinds of
meshes: each holds at least one transformer block and, with expert parallelism, one MoE block,
``marind.trainer.parallel.pipeline_spec``). Expert gradients are on ``(edp_shard, ep)`` meshes, so their
slice comes from the world mesh with ``dp_shard`` unflattened the same way (``pp_mesh`` may
name several world meshes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


@dataclass(frozen=True)
class GradLayout:
    """One gradient as the accounting sees it.

    Attributes:
        mesh: a key of its device mesh (equal meshes, equal keys); None for a plain tensor.
        mesh_size: ranks in that mesh (1 for a plain tensor).
        placements: per mesh dimension, ``"S"`` (sharded) or ``"R"`` (replicated).
        coordinate: this rank's coordinate in the mesh.
    """

    mesh: Hashable | None
    mesh_size: int
    placements: tuple[str, ...]
    coordinate: tuple[int, ...]


@dataclass(frozen=True)
class MeshReduction:
    """The gradients of one mesh: which this rank adds, and whether the mesh needs an all-reduce.

    Attributes:
        mesh: the mesh key.
        counted: indices (into the input) of the gradients this rank's sum includes.
        dropped: indices of the gradients whose local values another rank of the mesh counts.
        all_reduce: the mesh spans more than one rank.
    """

    mesh: Hashable | None
    counted: tuple[int, ...]
    dropped: tuple[int, ...]
    all_reduce: bool


def contributes(layout: GradLayout) -> bool:
    """Whether this rank's local sum of squares counts: coordinate 0 on every replicated dimension."""
    return all(c == 0 for c, p in zip(layout.coordinate, layout.placements, strict=True) if p == "R")


def reduction_plan(layouts: Sequence[GradLayout]) -> list[MeshReduction]:
    """Group gradients by mesh (first-seen order) and decide each one's part in the sum.

    Args:
        layouts: one per gradient, in parameter order.

    Returns:
        One :class:`MeshReduction` per distinct mesh: exactly one all-reduce per mesh of
        more than one rank, whatever the number of parameters or placements on it.
    """
    order: list[Hashable | None] = []
    counted: dict[Hashable | None, list[int]] = {}
    dropped: dict[Hashable | None, list[int]] = {}
    size: dict[Hashable | None, int] = {}
    for i, lay in enumerate(layouts):
        if lay.mesh not in size:
            order.append(lay.mesh)
            counted[lay.mesh], dropped[lay.mesh], size[lay.mesh] = [], [], lay.mesh_size
        (counted if contributes(lay) else dropped)[lay.mesh].append(i)
    return [MeshReduction(m, tuple(counted[m]), tuple(dropped[m]), size[m] > 1) for m in order]


def _layout(grad: torch.Tensor) -> GradLayout:
    if not isinstance(grad, DTensor):
        return GradLayout(None, 1, (), ())
    mesh = grad.device_mesh
    # Shard and _StridedShard (FSDP over a TP-sharded dim; not a Shard subclass) both split the tensor
    kinds = tuple("R" if isinstance(p, Replicate | Partial) else "S" for p in grad.placements)
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not in the gradient's mesh"
    return GradLayout(mesh, mesh.size(), kinds, tuple(coord))


_flat: dict[DeviceMesh, dist.ProcessGroup] = {}


def _dim_names(mesh: Hashable | None) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else ()


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over every rank of ``mesh`` (created once per mesh; collective the first time)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD  # type: ignore[return-value]
    if mesh not in _flat:
        name = "_".join(n for n in (mesh.mesh_dim_names or ())) or f"mesh{len(_flat)}"
        _flat[mesh] = mesh._flatten(f"gradnorm_{name}").get_group()
    return _flat[mesh]


def _pp_slice(pp_meshes: Sequence[DeviceMesh], names: tuple[str, ...]) -> DeviceMesh:
    """The ``("pp", *names)`` slice of the first of ``pp_meshes`` that has every one of ``names``."""
    for mesh in pp_meshes:
        if set(names) <= set(mesh.mesh_dim_names or ()):
            return mesh[("pp", *names)]
    raise ValueError(f"no pipeline world mesh has the gradient mesh dimensions {names}")


def _local(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor):
        if any(isinstance(p, Partial) for p in grad.placements):   # not made by FSDP2/TP; kept correct
            grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                 for p in grad.placements])
        return grad.to_local()
    return grad


@torch.no_grad()
def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float, *,
                   pp_mesh: DeviceMesh | Sequence[DeviceMesh] | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients (DTensors on any meshes), clipped to ``max_norm`` if > 0.

    Collective: one all-reduce per device mesh of more than one rank (see the module docstring).

    Args:
        params: the parameters (in the same order on every rank).
        max_norm: the clipping threshold; 0 or less only measures.
        pp_mesh: under pipeline parallelism, the world mesh (dimension ``pp`` first), or several
            (with expert parallelism also the one with ``(edp_shard, ep)``): each mesh's all-reduce
            spans the stages too, over the first of them that has its dimension names.

    Returns:
        The norm before clipping (float32, the same on every rank); a non-finite norm is
        returned without touching the gradients.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    locals_ = [_local(g) for g in grads]
    total: torch.Tensor | None = None
    plan = reduction_plan([_layout(g) for g in grads])
    if pp_mesh is not None:   # the same order on every stage (their meshes differ, their names do not)
        plan.sort(key=lambda red: _dim_names(red.mesh))
    for red in plan:
        device = locals_[(red.counted or red.dropped)[0]].device
        parts = [torch.linalg.vector_norm(locals_[i], dtype=torch.float32) ** 2 for i in red.counted]
        sq = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float32, device=device)
        if pp_mesh is not None:
            pp_meshes = (pp_mesh,) if isinstance(pp_mesh, DeviceMesh) else tuple(pp_mesh)
            dist.all_reduce(sq, group=_mesh_group(_pp_slice(pp_meshes, _dim_names(red.mesh))))
        elif red.all_reduce:
            assert isinstance(red.mesh, DeviceMesh)
            dist.all_reduce(sq, group=_mesh_group(red.mesh))
        total = sq if total is None else total + sq.to(total.device)
    assert total is not None
    norm = total.sqrt()
    if max_norm > 0 and torch.isfinite(norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return norm

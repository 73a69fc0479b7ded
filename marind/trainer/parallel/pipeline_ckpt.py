"""Checkpoints of a pipelined model: every rank presents every stage's arrays under their global names.

ckpt_store saves a state tree that every rank holds whole: each array sharded or replicated
over some mesh (``ckpt_store.agreement.agree_layout`` refuses anything else). A pipeline
stage holds its own layers only, so :class:`StageArrays` completes a rank's tree before a
save or a load: for every array that another stage holds (its parameters and optimizer state,
under global names such as ``model/layers.7.attention.wq.weight``) it adds a *stand-in*, a
DTensor of the same global shape, dtype and placements on a copy of the holder's mesh that
this rank is not part of. The store plans no chunk for a rank outside an array's mesh, so the
holders write every array once and the checkpoint holds plain global arrays, whatever the
layout; a load fills the stand-ins with nothing and :meth:`StageArrays.own` drops them
before the tree reaches the model. Plain tensors (Adam's ``step``) are replicated over the
world in the store's eyes, so their stand-ins carry the holder's value (one of them writes it).

What the stand-ins copy comes from one all-gather of each rank's array descriptions
(``ckpt_store.all_gather_json``) per save or load: collective on the world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ckpt_store import all_gather_json

#: sections of the checkpoint tree whose arrays belong to stages
STAGE_SECTIONS = ("model", "optim")
#: a plain tensor a stand-in may copy by value (Adam's scalar step)
MAX_PLAIN_ELEMENTS = 64


def encode_placement(p: Placement) -> list:
    """A placement as JSON: ``["S", dim]``, ``["SS", dim, split_factor]`` or ``["R"]``.

    Raises:
        ValueError: a placement a saved array cannot have (Partial).
    """
    if isinstance(p, _StridedShard):
        return ["SS", p.dim, p.split_factor]
    if isinstance(p, Shard):
        return ["S", p.dim]
    if isinstance(p, Replicate):
        return ["R"]
    raise ValueError(f"cannot describe placement {p} of a checkpointed array; reduce it first")


def decode_placement(row: list) -> Placement:
    """The inverse of :func:`encode_placement`."""
    if row[0] == "SS":
        return _StridedShard(row[1], split_factor=row[2])
    return Shard(row[1]) if row[0] == "S" else Replicate()


def _walk(tree: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            out.append(((*path, str(key)), value))
        elif isinstance(value, dict):
            out.extend(_walk(value, (*path, str(key))))
    return out


def describe(tree: dict) -> list[list]:
    """Rows describing the tensors of ``tree``'s stage sections (what a stand-in needs).

    Each row: ``[path, shape, stride, dtype, mesh ranks, mesh shape, mesh dim names, placements,
    value]`` (mesh fields and placements None for a plain tensor; value only for a plain one).

    Raises:
        ValueError: a plain tensor too large to copy by value.
    """
    rows: list[list] = []
    for section in STAGE_SECTIONS:
        for path, t in _walk(tree.get(section, {}), (section,)):
            dtype = str(t.dtype).removeprefix("torch.")
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                rows.append([list(path), list(t.shape), list(t.stride()), dtype, mesh.mesh.flatten().tolist(),
                             list(mesh.mesh.shape), list(mesh.mesh_dim_names or ()),
                             [encode_placement(p) for p in t.placements], None])
            else:
                if t.numel() > MAX_PLAIN_ELEMENTS:
                    raise ValueError(f"{'/'.join(path)}: a plain tensor of {t.numel()} elements in a pipeline "
                                     "checkpoint; only small replicated values (Adam's step) are supported")
                rows.append([list(path), list(t.shape), list(t.stride()), dtype, None, None, None, None,
                             t.detach().cpu().flatten().tolist()])
    return rows


def stand_in(row: list, device_type: str, meshes: dict | None = None) -> torch.Tensor:
    """The stand-in of a described tensor on a rank that does not hold it.

    Args:
        row: the tensor's :func:`describe` row.
        device_type: the stand-in mesh's device type.
        meshes: a cache of stand-in meshes by (ranks, shape, names), filled here.
    """
    _, shape, stride, dtype_name, ranks, mesh_shape, names, placements, value = row
    dtype = getattr(torch, dtype_name)
    if ranks is None:
        return torch.tensor(value, dtype=dtype).reshape(shape)
    key = (tuple(ranks), tuple(mesh_shape), tuple(names))
    mesh = (meshes or {}).get(key)
    if mesh is None:   # no process groups: nothing is ever sent over it
        mesh = DeviceMesh(device_type, torch.tensor(ranks).reshape(mesh_shape), mesh_dim_names=tuple(names) or None,
                          _init_backend=False)
        if meshes is not None:
            meshes[key] = mesh
    spec = DTensorSpec(mesh, tuple(decode_placement(p) for p in placements),
                       TensorMeta(torch.Size(shape), tuple(stride), dtype))
    local = torch.empty((0,) * len(shape), dtype=dtype)
    return DTensor(local, spec, requires_grad=False)


class StageArrays:
    """Completes a stage's checkpoint tree with stand-ins for the other stages' arrays.

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (the stand-ins' meshes).
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.added: list[tuple[str, ...]] = []
        self.meshes: dict = {}

    def complete(self, tree: dict[str, Any]) -> dict[str, Any]:
        """Add stand-ins for every stage array ``tree`` lacks (collective: every rank calls it).

        Args:
            tree: this rank's checkpoint tree (``Checkpointer.build_state``).

        Returns:
            ``tree``, completed in place.
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return tree
        held = {tuple(path) for path, _ in _walk({s: tree.get(s, {}) for s in STAGE_SECTIONS})}
        self.added = []
        for rows in all_gather_json(describe(tree)):
            for row in rows:
                path = tuple(row[0])
                if path in held:
                    continue
                held.add(path)
                node = tree
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = stand_in(row, self.device_type, self.meshes)
                self.added.append(path)
        return tree

    def own(self, tree: dict[str, Any]) -> dict[str, Any]:
        """Drop the stand-ins :meth:`complete` added (and the tables they leave empty).

        Returns:
            ``tree``, in place.
        """
        for path in self.added:
            nodes = [tree]
            for key in path[:-1]:
                nodes.append(nodes[-1][key])
            nodes[-1].pop(path[-1], None)
            for depth in range(len(path) - 1, 1, -1):   # tables under a section, never the section
                if nodes[depth]:
                    break
                nodes[depth - 1].pop(path[depth - 1], None)
        self.added = []
        return tree

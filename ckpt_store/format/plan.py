"""From a nested state dict to a save/load plan: array names, layouts, owned chunks, snapshots.

* ``flatten(state)`` splits the tree into tensors (by slash-joined name) and
  a tree of JSON values.
* ``plan_array(name, tensor, ...)`` gives the array's Zarr spec, this rank's
  pieces (contiguous global regions) and local tensor, and the chunks it writes.
* ``snapshot.reserve(plans, arena)`` and ``snapshot.fill`` (another module) copy the owned
  chunks to host memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckpt_store.format import layout
from ckpt_store.format.zarr_format import ArraySpec, dtype_name

INNER_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ArrayPlan:
    spec: ArraySpec
    pieces: tuple                  # this rank's Pieces of the global tensor
    local: torch.Tensor            # this rank's local tensor
    owned: tuple                   # (cell, piece) of each chunk this rank writes
    layout: dict                   # how the saving world held it (for the manifest / inspect)
    static: tuple = ()             # what the plan was made from, but the data (``static_plan``'s
                                   # arguments): equal for the same array held the same way; a
                                   # gathered plan (``gather``) keeps the one of the plan it replaced


def flatten(state: dict, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    values: dict = {}
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint state must be a dict, got {type(state).__name__}")
    for key, value in state.items():
        key = str(key)
        if "/" in key or key in ("", ".", "..") or key == "zarr.json":
            raise ValueError(f"state key {prefix + key!r} cannot name a Zarr node; rename it "
                             "(no '/', not empty, not 'zarr.json')")
        name = prefix + key
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, dict):
            sub_t, sub_v = flatten(value, name + "/")
            tensors.update(sub_t)
            if sub_v or not sub_t:
                values[key] = sub_v
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"state value {name!r} is neither a tensor nor JSON-able "
                                 f"({type(value).__name__}); convert it to JSON types") from exc
            values[key] = value
    return tensors, values


_MESHES: dict[int, tuple] = {}


def _mesh_info(mesh) -> tuple:
    """(mesh, global ranks in C order, mesh shape, ``_mesh_copies``), cached by mesh
    (``mesh.mesh`` is slow)."""
    hit = _MESHES.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        if len(_MESHES) > 256:
            _MESHES.clear()
        hit = (mesh, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), _mesh_copies(mesh))
        _MESHES[id(mesh)] = hit
    return hit


def mesh_ranks(mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global ranks in C order, mesh shape) of a DeviceMesh; cached."""
    _, ranks, shape, _ = _mesh_info(mesh)
    return ranks, shape


def mesh_copies(mesh) -> tuple[int, int]:
    """``_mesh_copies`` of ``mesh``, cached with its ranks."""
    return _mesh_info(mesh)[3]


def local_pieces(t: torch.Tensor, rank: int) -> tuple[list, torch.Tensor]:
    """This rank's pieces of the global tensor and the local tensor that holds them."""
    if isinstance(t, DTensor):
        ranks, mesh_shape = mesh_ranks(t.device_mesh)
        pieces = layout.rank_pieces(tuple(t.shape), ranks, mesh_shape, t.placements)
        return pieces.get(rank, []), t._local_tensor
    return [layout.Piece((0,) * t.dim(), layout.full_box(tuple(t.shape)))], t


def plan_array(name: str, t: torch.Tensor, rank: int, world: int, salt: int,
               inner_bytes: int = INNER_CHUNK_BYTES) -> ArrayPlan:
    shape = tuple(t.shape)
    dtype = dtype_name(t.dtype)
    if isinstance(t, DTensor):
        _check_placements(t)
        mesh = t.device_mesh
        ranks, mesh_shape = mesh_ranks(mesh)
        where = (ranks, mesh_shape, tuple(layout.placement_spec(p) for p in t.placements),
                 tuple(mesh.mesh_dim_names or ()), tuple(str(p) for p in t.placements), mesh_copies(mesh))
        local = t._local_tensor
    else:
        where = None
        local = t
    static = (name, shape, dtype, t.element_size(), rank, world, salt, inner_bytes, where)
    spec, mine, owned, how = static_plan(*static)
    return ArrayPlan(spec, mine, local, owned, how, static)


def static_where(static: tuple) -> tuple | None:
    """How the array of a plan made from ``static`` (``ArrayPlan.static``) was held: ``plan_array``'s
    ``where`` (mesh ranks, mesh shape, placement specs, ...), or None for a plain tensor."""
    return static[-1] if static else None


def static_pieces(shape: tuple[int, ...], world: int, where: tuple | None) -> dict[int, list]:
    """Every rank's pieces of an array held as ``where`` says (``plan_array``'s; None: replicated
    on all ``world`` ranks)."""
    if where is None:
        return layout.replicated_pieces(shape, world)
    ranks, mesh_shape, specs = where[:3]
    return layout.pieces_from_specs(shape, ranks, mesh_shape, specs)


@lru_cache(maxsize=65536)
def static_plan(name, shape, dtype, itemsize, rank, world, salt, inner_bytes, where):
    """The part of a plan that depends only on shapes and layout (cached: every save of a
    training run asks for the same ones)."""
    pieces = static_pieces(shape, world, where)
    if where is not None:
        _, mesh_shape, _, dim_names, placement_names, copies = where
        how: dict[str, Any] = {"mesh_shape": list(mesh_shape), "mesh_dim_names": list(dim_names),
               "placements": list(placement_names)}
    else:
        how = {"replicated": True}
        copies = (0, 1)
    mine = tuple(pieces.get(rank, []))
    chunks = layout.chunk_grid(shape, pieces)
    rows = None
    if shape and all(s > 0 for s in shape):
        r = layout.inner_rows(chunks, itemsize, inner_bytes)
        rows = r if r < chunks[0] else None
    spec = ArraySpec(name, shape, dtype, chunks, rows)
    owned = tuple(layout.owned_cells(shape, chunks, pieces, rank, salt, copies))
    return spec, mine, owned, how


def _mesh_copies(mesh) -> tuple[int, int]:
    """(which, how many): the sub-meshes of ``mesh``'s root mesh that are copies of it.

    A DTensor on ``root["dp"]`` of a (dp, tp) mesh (FSDP2 over a parameter that
    tensor parallelism leaves alone) is held by every tp rank, each on its own
    dp sub-mesh, with the same values: the tp coordinate says which copy this
    rank is in, and the copies take turns writing chunks (``owned_cells``). Every
    rank holds every array of a save (checked before any writing), so the copies
    all exist. A mesh that is its own root, or a sub-mesh whose dims the root does
    not name (a flattened dim), counts as the only copy: its chunks are then
    written once per copy, with the same bytes.
    """
    try:
        root = mesh._get_root_mesh()
    except Exception:  # noqa: BLE001 - an older DeviceMesh: no sub-meshes to tell apart
        return (0, 1)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or not names or not root_names or any(n not in root_names for n in names):
        return (0, 1)
    coord = root.get_coordinate()
    if coord is None:
        return (0, 1)
    which, count = 0, 1
    for i, name in enumerate(root_names):
        if name not in names:
            which, count = which * root.mesh.shape[i] + coord[i], count * root.mesh.shape[i]
    # the names must say where the mesh lies: its ranks are the root's with the other coordinates fixed
    mine = root.mesh[tuple(slice(None) if n in names else coord[i] for i, n in enumerate(root_names))]
    order = [n for n in root_names if n in names]
    if order != list(names) or mine.flatten().tolist() != mesh.mesh.flatten().tolist():
        return (0, 1)
    return (which, count)


def _check_placements(t: DTensor) -> None:
    for p in t.placements:
        if p.is_partial():
            raise ValueError("cannot checkpoint a DTensor with Partial placement; "
                             "reduce it (redistribute to Replicate/Shard) first")

"""Expert parallelism: experts sharded over an ``ep`` mesh dimension, tokens moved by all-to-all.

Mesh rule: ``ep`` borrows from ``dp_shard``: ``parallel.ep`` divides ``dp_shard``, and the
``dp_shard`` dimension of the trainer's mesh is unflattened into ``(edp_shard, ep)`` with
``edp_shard = dp_shard / ep`` (``ep`` innermost, so an expert group is ``ep`` neighbouring
data-parallel ranks). Every rank still reads its own data (``dp_rank`` and ``dp_size`` do not
change). Dense parameters are as before (TP, FSDP over ``dp_shard``). Expert parameters
(``feed_forward.experts.w1/w2/w3``, ``[E, ...]``) are DTensors ``Shard(0)`` over ``ep`` (this
rank holds ``E / ep`` experts), then FSDP-sharded over ``edp_shard`` (HSDP with
``dp_replicate``); they are not tensor-parallel (with ``tp > 1`` each TP rank runs the same
experts on the same tokens, in its own expert group).

Dispatch (:func:`dispatch_and_run`, which :func:`parallelize_experts` installs in each experts
module as an :class:`AllToAllDispatcher`, the model's ``moe.ExpertDispatcher``): a rank's
assignments, sorted by global expert, go to the expert's owner with ``all_to_all_single`` and
per-rank split sizes (first an all-to-all of the per-expert counts), are regrouped by local
expert, run, put back in arrival order and returned by the reverse all-to-all. Both all-to-alls are autograd functions (the backward is
the all-to-all with the splits swapped). Plain ``torch.distributed`` collectives: gloo on CPU,
nccl on GPU.

Gradients: an expert's gradient on its owner already sums the contributions of the tokens of
all ``ep`` ranks (through the all-to-all's backward), so FSDP reduces it over the ranks that
replicate the expert (``dp_replicate x edp_shard``) and divides by the whole data-parallel size
(``set_gradient_divide_factor(dp_size)``, with sum-only collectives so gloo runs it too), the same mean over every rank's tokens that the
dense gradients get. With ``ep = dp_shard`` (one ``edp_shard`` rank) there is no reduce-scatter
and the sum-only mode stays off: torch 2.13's FSDP divides a one-rank group's gradient by the
factor twice under it. Checkpoints save expert arrays under their global names with their global
``[E, ...]`` shape (``get_state_dict`` of the DTensors), restorable into any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from marind.trainer.model.moe import MoE, moe_layers, run_experts

__all__ = ["AllToAllDispatcher", "dispatch_and_run", "expert_mesh", "parallelize_experts", "split_sizes",
           "tp_plan_for"]


def split_sizes(send_counts: list[int], recv_counts: list[int], ep: int) -> tuple[list[int], list[int], list[int]]:
    """The all-to-all arithmetic of one dispatch (pure).

    Args:
        send_counts: this rank's assignments per global expert (``E`` values; expert ``e`` lives on
            ep rank ``e // (E / ep)``).
        recv_counts: per source ep rank, its assignments to each of this rank's experts
            (``ep x E/ep`` values, source-major).
        ep: ranks in the expert group.

    Returns:
        (rows sent to each ep rank, rows received from each ep rank, rows per local expert).
    """
    per = len(send_counts) // ep
    send = [sum(send_counts[r * per:(r + 1) * per]) for r in range(ep)]
    recv = [sum(recv_counts[r * per:(r + 1) * per]) for r in range(ep)]
    local = [sum(recv_counts[r * per + e] for r in range(ep)) for e in range(per)]
    return send, recv, local


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def dispatch_and_run(x: torch.Tensor, counts: torch.Tensor,
                     weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     group: dist.ProcessGroup) -> torch.Tensor:
    """Run rows sorted by global expert on the experts' owners (collective over ``group``).

    Args:
        x: ``[rows, dim]``, grouped by global expert.
        counts: int64 ``[E]``, rows per global expert.
        weights: this rank's ``(w1, w3, w2)`` local shards, ``[E/ep, ...]`` each.
        group: the expert-parallel group.

    Returns:
        The experts' outputs, in ``x``'s order.
    """
    ep = dist.get_world_size(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    send, recv, local = split_sizes(counts.tolist(), recv_counts.tolist(), ep)
    arrived = _AllToAll.apply(x, recv, send, group)
    per = counts.numel() // ep
    expert_of = torch.arange(per, device=x.device).repeat(ep).repeat_interleave(recv_counts)
    perm = torch.argsort(expert_of, stable=True)              # arrival order -> grouped by local expert
    y = run_experts(arrived[perm], local, *weights)
    back = y[torch.argsort(perm)]
    return _AllToAll.apply(back, send, recv, group)


class AllToAllDispatcher:
    """The ``moe.ExpertDispatcher`` of sharded experts: :func:`dispatch_and_run` over ``group``.

    Args:
        group: the expert-parallel process group (the ``ep`` slice of the expert mesh).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return dispatch_and_run(x, counts, weights, self.group)


#: the expert meshes made so far, by (id of the mesh, ep): (that mesh, its expert mesh)
_EXPERT_MESHES: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The trainer's mesh with ``dp_shard`` unflattened into ``(edp_shard, ep)`` (collective the first
    time for ``mesh``: a pipeline makes every stage's on every rank first, ``marind.trainer.parallel.pipeline``).

    Args:
        mesh: the ``(dp_replicate, dp_shard, tp)`` mesh of ``marind.trainer.parallel.mesh.build_mesh`` (or
            a pipeline stage's, or the pipeline's world mesh with ``pp`` in front).
        ep: expert-parallel ranks (divides ``dp_shard``; checked at submit).

    Returns:
        The ``(dp_replicate, edp_shard, ep, tp)`` mesh.
    """
    hit = _EXPERT_MESHES.get((id(mesh), ep))
    if hit is not None and hit[0] is mesh:   # built once per mesh: the unflatten creates process groups
        return hit[1]
    ds = mesh["dp_shard"].size()
    full = mesh._unflatten("dp_shard", (ds // ep, ep), ("edp_shard", "ep"))
    _EXPERT_MESHES[(id(mesh), ep)] = (mesh, full)
    return full


def tp_plan_for(block: nn.Module, dense_plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A block's tensor-parallel plan: the dense plan, or for a MoE block its attention entries and
    the shared experts as the dense MLP (router and routed experts stay whole on each TP rank)."""
    ff = getattr(block, "feed_forward", None)
    if not isinstance(ff, MoE):
        return dense_plan
    plan = {k: v for k, v in dense_plan.items() if not k.startswith("feed_forward.")}
    if ff.shared is not None:
        plan |= {"feed_forward.shared.w1": ColwiseParallel(), "feed_forward.shared.w3": ColwiseParallel(),
                 "feed_forward.shared.w2": RowwiseParallel()}
    return plan


def parallelize_experts(model: nn.Module, mesh: DeviceMesh, *, ep: int, mp_policy: MixedPrecisionPolicy,
                        dp_size: int) -> None:
    """Shard the experts of ``model`` (on the meta device) over ``ep`` and FSDP over ``edp_shard``.

    Call before the blocks' ``fully_shard`` (each experts module becomes its own FSDP unit).
    With ``ep == 1`` nothing happens: the experts are plain parameters of their block's FSDP unit.

    Args:
        model: the model, not yet materialized.
        mesh: the trainer's mesh (``build_mesh``).
        ep: ``parallel.ep``.
        mp_policy: the blocks' mixed-precision policy.
        dp_size: data-parallel ranks (``dp_replicate x dp_shard``): the gradients' divisor.
    """
    layers = moe_layers(model)
    if ep == 1 or not layers:
        return
    full = expert_mesh(mesh, ep)
    ep_mesh = full["ep"]
    dp_mesh = full["dp_replicate", "edp_shard"] if full["dp_replicate"].size() > 1 else full["edp_shard"]
    for moe in layers:
        ex = moe.experts
        for name, p in list(ex.named_parameters(recurse=False)):
            ex.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)],
                                                                       src_data_rank=None)))
        ex.dispatcher = AllToAllDispatcher(ep_mesh.get_group())
        fully_shard(ex, mesh=dp_mesh, mp_policy=mp_policy)
        ex.set_gradient_divide_factor(float(dp_size))  # type: ignore[operator]
        if full["edp_shard"].size() > 1:   # SUM then divide: gloo too. Not with one edp_shard rank: FSDP
            ex.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # would divide twice (torch 2.13)

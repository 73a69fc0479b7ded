"""Mixture of experts through pipeline stages: auxiliary losses and router statistics per stage.

Without pipeline parallelism the loop adds the MoE layers' auxiliary loss (load balance and
router z-loss, ``marind.trainer.model.moe``) to each micro-batch's loss and sums their router
statistics (``take_moe_outputs``). A pipeline schedule runs the forwards and backwards of a
stage itself and only the last stage has a loss, so each MoE layer of a stage instead carries
an :class:`AuxSink` as its ``aux_hook`` (the model's ``moe.AuxHook``, which the layer calls with
its output, aux loss and statistics):

* **Loss.** The layer's output passes through :func:`attach_aux`, the identity in the forward;
  its backward passes the output's gradient through unchanged and gives the layer's aux loss
  the gradient ``scale`` (``1 / run.accum``), so the stage's backward (``stage.backward`` of the
  schedule) adds ``d(aux / accum)/d(parameters)``: the gradients of the unsplit loop's
  ``lm_loss / accum + aux / accum`` per micro-batch, up to float order.
* **Statistics.** The same backward adds the layer's statistics of that micro-batch to the
  sink: once per micro-batch that is trained, whatever activation checkpointing recomputes
  (a recompute builds a graph whose backward never runs). The schedule's metadata inference,
  a forward and backward on placeholder tensors before the first step, is not counted
  (:class:`MoEStage` pauses the sinks around it).

:func:`router_stats` lays a rank's sums into the unsplit model's ``[MoE layers, E + 3]`` order
(zeros for the layers other stages hold), so the loop's all-reduce sums every stage's layers
exactly as without pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from marind.trainer.model.moe import MoE, is_moe_layer


class AuxSink:
    """What one MoE layer of a pipeline stage gives the step: the aux gradient scale and statistics.

    Args:
        index: the layer's place among the model's MoE layers (0 = the first MoE block).
        scale: the gradient of the step's loss with respect to this layer's aux loss (``1 / accum``).
    """

    def __init__(self, index: int, scale: float) -> None:
        self.index = index
        self.scale = scale
        self.paused = False
        self.total: torch.Tensor | None = None

    def __call__(self, out: torch.Tensor, aux: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """The layer's hook (``moe.AuxHook``): ``out`` through :func:`attach_aux` into this sink."""
        return attach_aux(out, aux, self, stats)

    def record(self, stats: torch.Tensor) -> None:
        """Add one trained micro-batch's statistics (``[E + 3]`` float64), unless paused."""
        if not self.paused:
            self.total = stats.clone() if self.total is None else self.total + stats

    def take(self) -> torch.Tensor | None:
        """The statistics summed since the last call (None: no micro-batch), and reset."""
        total, self.total = self.total, None
        return total


class _AttachAux(torch.autograd.Function):
    """Identity on ``out``; the backward gives ``aux`` the gradient ``sink.scale`` and records the stats."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, sink: AuxSink,
                stats: torch.Tensor) -> torch.Tensor:
        ctx.sink, ctx.stats = sink, stats
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        ctx.sink.record(ctx.stats)
        shape, dtype, device = ctx.aux_like
        aux_grad = torch.full(shape, ctx.sink.scale, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad, aux_grad, None, None


@torch.compiler.disable
def attach_aux(out: torch.Tensor, aux: torch.Tensor, sink: AuxSink, stats: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with ``aux`` (scaled by ``sink.scale``) in its backward and ``stats``
    recorded into ``sink`` when that backward runs (see the module docstring)."""
    return _AttachAux.apply(out, aux, sink, stats.detach())


def install_sinks(pieces: Sequence[nn.Module], *, n_experts: int, moe_every: int, scale: float) -> list[AuxSink]:
    """Give every MoE layer of a rank's stage pieces its sink (as the layer's ``aux_hook``).

    Args:
        pieces: the rank's stage modules (``StageModel``: ``layers`` keyed by global layer index).
        n_experts: ``model.n_experts``.
        moe_every: ``model.moe_every``.
        scale: the aux loss's gradient (``1 / accum``).

    Returns:
        The sinks, in the order of the rank's layers.
    """
    sinks = []
    for piece in pieces:
        layers = piece.layers
        assert isinstance(layers, nn.ModuleDict)
        for key, block in layers.items():
            moes = [m for m in block.modules() if isinstance(m, MoE)]
            if not moes:
                continue
            layer = int(key)
            index = sum(is_moe_layer(j, n_experts=n_experts, moe_every=moe_every) for j in range(layer))
            sink = AuxSink(index, scale)
            moes[0].aux_hook = sink
            sinks.append(sink)
    return sinks


def moe_layer_count(*, n_layers: int, n_experts: int, moe_every: int) -> int:
    """MoE blocks in the whole model."""
    return sum(is_moe_layer(j, n_experts=n_experts, moe_every=moe_every) for j in range(n_layers))


def router_stats(sinks: Sequence[AuxSink], *, n_moe: int, n_experts: int,
                 device: torch.device) -> torch.Tensor:
    """This rank's statistics of the step in the unsplit model's layout, flattened (and the sinks reset).

    Args:
        sinks: the rank's sinks.
        n_moe: MoE layers of the whole model.
        n_experts: experts per MoE layer.
        device: where the loop all-reduces.

    Returns:
        float64 ``[n_moe x (E + 3)]``: each of this rank's MoE layers in its row, zeros elsewhere;
        empty for a dense model.
    """
    if n_moe == 0:
        return torch.zeros(0, device=device, dtype=torch.float64)
    out = torch.zeros(n_moe, n_experts + 3, device=device, dtype=torch.float64)
    for sink in sinks:
        total = sink.take()
        if total is not None:
            out[sink.index] += total.to(device)
    return out.flatten()


@contextmanager
def paused(sinks: Sequence[AuxSink]) -> Iterator[None]:
    """Sinks that record nothing inside the block."""
    for s in sinks:
        s.paused = True
    try:
        yield
    finally:
        for s in sinks:
            s.paused = False


class MoEStage(PipelineStage):
    """A ``PipelineStage`` whose MoE sinks do not count the schedule's metadata inference.

    Args:
        sinks: the MoE sinks of this stage's module (may be empty).
        *args, **kwargs: as for ``PipelineStage``.
    """

    def __init__(self, *args: Any, sinks: Sequence[AuxSink] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = list(sinks)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with paused(self.sinks):
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with paused(self.sinks):
            return super()._prepare_backward_infra(*args, **kwargs)

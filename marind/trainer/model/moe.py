"""Mixture of experts: a top-k router in float32 and stacked SwiGLU experts.

Every ``moe_every``-th block (``(layer + 1) % moe_every == 0``) replaces its MLP with
:class:`MoE`: a linear router (``feed_forward.gate``, logits and softmax in float32), the
top ``top_k`` experts per token weighted by their softmax probabilities renormalized over
the chosen ``k`` (Mixtral's gating), optional shared experts that see every token
(``feed_forward.shared``, one SwiGLU of ``n_shared_experts x moe_ffn_dim``), and the routed
experts stored stacked: one parameter per projection with a leading expert axis
(``feed_forward.experts.w1`` / ``w3`` ``[E, dim, hidden]``, ``w2`` ``[E, hidden, dim]``), so a
checkpoint holds the global ``[E, ...]`` array whatever the expert-parallel layout.

Capacity: ``capacity_factor`` 0 is dropless; otherwise each expert takes at most
``ceil(capacity_factor x tokens x top_k / n_experts)`` of a rank's micro-batch assignments
(the earliest tokens first) and the rest are dropped (their token keeps the shared experts and
the residual). Auxiliary losses per MoE layer, on this rank's micro-batch: the load-balancing
loss ``E x sum_e f_e P_e`` (``f_e`` the fraction of assignments routed to expert ``e`` before
drops, ``P_e`` its mean router probability; 1.0 when perfectly balanced) and the router z-loss
``mean(logsumexp(logits)^2)``. :func:`take_moe_outputs` collects them after a forward: the
loop adds ``load_balance_coef x balance + router_z_loss_coef x z`` (summed over MoE layers)
to the loss and reports the raw values with the router statistics.

Under pipeline parallelism the pipeline installs an :class:`AuxHook` on each stage's MoE layer
(:attr:`MoE.aux_hook`): the layer hands it its output, aux loss and statistics instead of keeping
them, so the aux loss joins the stage's backward, since the pipeline's schedule, not the loop, runs
the micro-batches.

The routed experts run through an :class:`ExpertDispatcher` (:attr:`GroupedExperts.dispatcher`),
:class:`LocalDispatcher` by default; expert parallelism shards the experts' leading axis and
installs one that crosses ranks by all-to-all. The model defines both seams and imports no
parallelism code: the parallelism modules build on the model, never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of the model's shape (``[model]`` keys of the same names)."""

    dim: int
    n_experts: int
    top_k: int
    moe_ffn_dim: int
    n_shared_experts: int = 0
    capacity_factor: float = 0.0
    router_z_loss_coef: float = 0.0
    load_balance_coef: float = 0.0


def is_moe_layer(layer: int, *, n_experts: int, moe_every: int) -> bool:
    """Whether block ``layer`` (0-based) has a MoE MLP: experts on and ``(layer + 1) % moe_every == 0``."""
    return n_experts > 0 and (layer + 1) % moe_every == 0


def expert_capacity(tokens: int, *, top_k: int, n_experts: int, capacity_factor: float) -> int | None:
    """Assignments one expert takes from a micro-batch of ``tokens``; None when dropless (factor 0)."""
    if capacity_factor <= 0:
        return None
    return max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``(silu(x w1) * (x w3)) w2`` with weights stored ``[in, out]``."""
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def run_experts(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for local expert ``e``, in order) through
    their experts; the stacked weights are unbound once so the backward stacks the gradients once."""
    outs = [swiglu(chunk, a, b, c) for chunk, a, b, c in
            zip(x.split(counts), w1.unbind(0), w3.unbind(0), w2.unbind(0), strict=True)]
    return torch.cat(outs) if outs else x[:0]


class ExpertDispatcher(Protocol):
    """How :class:`GroupedExperts` runs its rows: the seam expert parallelism fills (the model imports none of it)."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rows of ``x`` sorted by global expert (``counts``: rows per expert, int64 ``[E]``) through their
        experts, in the same order; ``weights`` are this rank's ``(w1, w3, w2)`` (local shards)."""
        ...


class LocalDispatcher:
    """Every expert on this rank: the rows go straight through :func:`run_experts`."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return run_experts(x, counts.tolist(), *weights)


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, one stacked parameter per projection.

    Attributes:
        dispatcher: runs the rows on the experts' owners; :class:`LocalDispatcher` unless expert
            parallelism installed its own.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.dispatcher: ExpertDispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by global expert (``counts``: rows per expert, int64 ``[E]``) through
        their experts, in the same order."""
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        return self.dispatcher(x, counts, (w1, w3, w2))


class SharedExperts(nn.Module):
    """The always-on experts: one SwiGLU MLP (``w1``/``w3``/``w2`` linears, tensor-parallel like the dense MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(frozen=True)
class MoEOutputs:
    """What the MoE layers of one forward leave for the loss and the step log.

    Attributes:
        aux_loss: ``sum over layers (load_balance_coef x balance + router_z_loss_coef x z)``, with grad.
        stats: float64 ``[layers, E + 3]``: per layer the assignments per expert (before drops),
            the dropped assignments, the balance loss and the z-loss (detached).
    """

    aux_loss: torch.Tensor
    stats: torch.Tensor


class AuxHook(Protocol):
    """Takes a MoE layer's aux loss and statistics instead of :attr:`MoE.last` (a pipeline stage's layer,
    whose micro-batches the schedule runs, not the loop); returns the layer's output."""

    def __call__(self, out: torch.Tensor, aux: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """``out``: the layer's output; ``aux``: its aux loss (with grad); ``stats``: ``[E + 3]`` float64."""
        ...


class MoE(nn.Module):
    """A MoE MLP: router, routed experts, optional shared experts (see the module docstring)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared = SharedExperts(cfg.dim, cfg.n_shared_experts * cfg.moe_ffn_dim) \
            if cfg.n_shared_experts else None
        self.last: MoEOutputs | None = None
        self.aux_hook: AuxHook | None = None   # pipeline stages: aux loss and stats in the backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n = tokens.shape[0]
        gate_w = self.gate.weight
        logits = F.linear(tokens.float(), gate_w.float())
        probs = logits.softmax(dim=-1)
        top_p, top_i = probs.topk(c.top_k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)            # assignments grouped by expert, token order kept
        sorted_e = flat_e[order]
        counts = torch.bincount(flat_e, minlength=c.n_experts)
        cap = expert_capacity(n, top_k=c.top_k, n_experts=c.n_experts, capacity_factor=c.capacity_factor)
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if cap is not None:
            starts = torch.cumsum(counts, 0) - counts
            keep = torch.arange(order.numel(), device=x.device) - starts[sorted_e] < cap
            order, sorted_e = order[keep], sorted_e[keep]
            kept = torch.clamp(counts, max=cap)
            dropped = (counts - kept).sum()
        else:
            kept = counts
        token_of = order // c.top_k
        y = self.experts(tokens[token_of], kept)
        gate_of = weights.reshape(-1)[order].to(y.dtype)
        out = torch.zeros_like(tokens, dtype=y.dtype).index_add(0, token_of, y * gate_of[:, None])
        if self.shared is not None:
            out = out + self.shared(tokens)
        frac = counts.float() / float(n * c.top_k)
        balance = c.n_experts * (frac * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        aux = c.load_balance_coef * balance + c.router_z_loss_coef * z
        stats = torch.cat([counts.double(), dropped.double().reshape(1),
                           balance.detach().double().reshape(1), z.detach().double().reshape(1)])
        result = out.reshape(shape).to(x.dtype)
        if self.aux_hook is not None:   # under pipeline parallelism (installed by the pipeline)
            return self.aux_hook(result, aux, stats)
        self.last = MoEOutputs(aux, stats[None])
        return result


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE modules, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def take_moe_outputs(model: nn.Module) -> MoEOutputs | None:
    """The aux loss and statistics the last forward left in ``model``'s MoE layers (cleared); None
    for a dense model. Call it after the forward and before the backward (an activation-checkpoint
    recompute writes them again)."""
    outs = []
    for m in moe_layers(model):
        if m.last is not None:
            outs.append(m.last)
            m.last = None
    if not outs:
        return None
    aux = torch.stack([o.aux_loss for o in outs]).sum()
    return MoEOutputs(aux, torch.cat([o.stats for o in outs]))


def router_summary(stats: torch.Tensor, *, replicas: int, samples: int) -> dict[str, float | list[int]]:
    """The step log's router fields from the step's statistics summed over micro-batches and ranks.

    Args:
        stats: ``[layers, E + 3]`` as in :class:`MoEOutputs`, summed over every micro-batch of every rank.
        replicas: ranks that route the same tokens (``tp``): counts are divided by it.
        samples: (rank, micro-batch) pairs summed (world x accumulation): losses are averaged over them.

    Returns:
        ``moe_tokens_per_expert`` (assignments per expert, summed over layers), ``moe_load_min`` /
        ``moe_load_max`` (the least and most loaded expert of any layer over the mean: 1.0 is
        balanced), ``moe_dropped`` (assignments dropped by the capacity), ``moe_balance_loss`` and
        ``moe_z_loss`` (summed over layers, averaged over micro-batches and ranks, before coefficients).
    """
    s = stats.double()
    counts = s[:, :-3] / replicas
    mean = counts.mean(dim=1).clamp(min=1e-12)
    return {
        "moe_tokens_per_expert": [round(float(v)) for v in counts.sum(dim=0)],
        "moe_load_min": round(float((counts.min(dim=1).values / mean).min()), 4),
        "moe_load_max": round(float((counts.max(dim=1).values / mean).max()), 4),
        "moe_dropped": round(float(s[:, -3].sum()) / replicas),
        "moe_balance_loss": round(float(s[:, -2].sum()) / samples, 6),
        "moe_z_loss": round(float(s[:, -1].sum()) / samples, 6),
    }


def moe_param_counts(*, dim: int, n_experts: int, top_k: int, moe_ffn_dim: int,
                     n_shared_experts: int) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE MLP: router, all/top-k experts, shared experts."""
    expert = 3 * dim * moe_ffn_dim
    fixed = dim * n_experts + n_shared_experts * expert
    return fixed + n_experts * expert, fixed + top_k * expert

"""The mixture-of-experts part of the trainer's spec: MoE presets and the checks of ``[model]``'s
MoE keys and ``parallel.ep`` (one-line ``SpecError`` naming the key and the fix).

``marind.trainer.config`` calls :func:`resolve_moe` after a preset's dims are filled in,
:func:`validate_moe` with the other world-independent checks and :func:`validate_ep_for_world`
at each world size (``ep`` must divide that world's ``dp_shard``). Pure functions over the
spec's dataclasses; nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marind.core.errors import SpecError

#: MoE presets: every ``[model]`` key they set (a key given in run.toml wins).
#: ``mixtral-8x7b`` has Mixtral 8x7B's widths, depth, experts and routing but full multi-head
#: attention (the trainer has no grouped-query attention), so its attention is larger: for docs
#: and FLOP counts (``param_count``/``flops_per_token``), not for CPU tests.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "moe-tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 192, "n_experts": 4, "top_k": 2,
                 "n_shared_experts": 1, "moe_every": 1, "moe_ffn_dim": 64},
    "mixtral-8x7b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "ffn_dim": 14336, "n_experts": 8, "top_k": 2,
                     "n_shared_experts": 0, "moe_every": 1, "moe_ffn_dim": 14336, "rope_theta": 1e6,
                     "tie_embeddings": False, "vocab_size": 32000},
}


def preset_dims(preset: str) -> tuple[int, int, int]:
    """(dim, n_layers, n_heads) of a MoE preset."""
    p = MOE_PRESETS[preset]
    return p["dim"], p["n_layers"], p["n_heads"]


def resolve_moe(model: Any, given: set[str]) -> Any:
    """``model`` (a ``ModelSpec`` with its dims resolved) with a MoE preset's other keys filled in
    where run.toml does not set them, and ``moe_ffn_dim`` 0 resolved to ``ffn_dim``."""
    fill = {k: v for k, v in MOE_PRESETS.get(model.preset, {}).items()
            if k not in given and k not in ("dim", "n_layers", "n_heads")}
    if "ffn_dim" in fill and "dim" in given:   # a changed width keeps the preset's ratio, not its number
        fill.pop("ffn_dim")
    model = dataclasses.replace(model, **fill)
    if model.moe_ffn_dim == 0:
        model = dataclasses.replace(model, moe_ffn_dim=model.ffn_dim)
    return model


def validate_moe(model: Any, parallel: Any) -> None:
    """The MoE keys of ``[model]`` and ``parallel.ep``, without a world size.

    Raises:
        SpecError: the first problem, in one line.
    """
    m, p = model, parallel
    if p.ep < 1:
        raise SpecError(f"parallel.ep must be >= 1, got {p.ep}")
    if m.n_experts < 0:
        raise SpecError(f"model.n_experts must be >= 0 (0 = a dense model), got {m.n_experts}")
    if m.n_experts == 0:
        if p.ep > 1:
            raise SpecError(f"parallel.ep = {p.ep} needs a mixture-of-experts model; set model.n_experts "
                            f"(or preset = \"moe-tiny\") or parallel.ep = 1")
        return
    if not 1 <= m.top_k <= m.n_experts:
        raise SpecError(f"model.top_k = {m.top_k} must be in [1, model.n_experts = {m.n_experts}]")
    if m.moe_every < 1:
        raise SpecError(f"model.moe_every must be >= 1 (1 = every block is MoE), got {m.moe_every}")
    if m.moe_every > m.n_layers:
        raise SpecError(f"model.moe_every = {m.moe_every} exceeds model.n_layers = {m.n_layers}: no block would "
                        f"be MoE; lower it or set model.n_experts = 0")
    if m.n_shared_experts < 0:
        raise SpecError(f"model.n_shared_experts must be >= 0, got {m.n_shared_experts}")
    if m.moe_ffn_dim < 1:
        raise SpecError(f"model.moe_ffn_dim must be > 0 (0 = model.ffn_dim), got {m.moe_ffn_dim}")
    if m.capacity_factor < 0:
        raise SpecError(f"model.capacity_factor must be >= 0 (0 = dropless), got {m.capacity_factor}")
    for key in ("router_z_loss_coef", "load_balance_coef"):
        if getattr(m, key) < 0:
            raise SpecError(f"model.{key} must be >= 0, got {getattr(m, key)}")
    if m.init_from:
        raise SpecError(f"model.init_from loads a dense Llama; a mixture-of-experts model (model.n_experts = "
                        f"{m.n_experts}) cannot start from it: remove init_from or set model.n_experts = 0")
    if m.n_experts % p.ep:
        raise SpecError(f"parallel.ep = {p.ep} must divide model.n_experts = {m.n_experts}; "
                        f"pick a divisor of {m.n_experts}")
    if m.n_shared_experts and (m.n_shared_experts * m.moe_ffn_dim) % p.tp:
        raise SpecError(f"parallel.tp = {p.tp} must divide the shared experts' width model.n_shared_experts x "
                        f"model.moe_ffn_dim = {m.n_shared_experts * m.moe_ffn_dim}")


def validate_ep_for_world(ep: int, dp_shard: int) -> None:
    """``ep`` borrows from ``dp_shard``: it must divide the world's ``dp_shard``.

    Raises:
        SpecError: it does not.
    """
    if dp_shard % ep:
        raise SpecError(f"parallel.ep = {ep} must divide parallel.dp_shard = {dp_shard} (expert parallelism "
                        f"borrows the dp_shard ranks); change ep, dp_shard or the number of processes")

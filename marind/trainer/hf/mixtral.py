"""The trainer's mixture-of-experts GPT as a Hugging Face ``MixtralForCausalLM``: config and names.

Pure functions over plain data, used by ``marind ckpt export --format hf`` for a checkpoint
whose model config has ``n_experts > 0``. A Mixtral is the trainer's MoE GPT with every block
MoE (``moe_every = 1``), no shared experts, full multi-head attention written as
``num_key_value_heads = num_attention_heads``; the router is the same (softmax over the
experts in float32, top ``k`` renormalized), and expert ``e``'s SwiGLU is ``w2(silu(w1 x) * w3 x)``.
Attention, norms, embeddings and head are named as in ``marind.trainer.hf.mapping`` (the
rotary rows of ``wq``/``wk`` permuted the same way). The MoE names (``N`` = layer)::

    layers.N.feed_forward.gate.weight       model.layers.N.block_sparse_moe.gate.weight
    layers.N.feed_forward.experts.w1[e]     model.layers.N.block_sparse_moe.experts.e.w1.weight  (transposed)
    layers.N.feed_forward.experts.w3[e]     model.layers.N.block_sparse_moe.experts.e.w3.weight  (transposed)
    layers.N.feed_forward.experts.w2[e]     model.layers.N.block_sparse_moe.experts.e.w2.weight  (transposed)

The stacked arrays are stored ``[E, in, out]``; Mixtral's per-expert linears are ``[out, in]``
(Mixtral's original layout; transformers 5 fuses them when it loads them).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from marind.trainer.hf.mapping import hf_config, hf_name

if TYPE_CHECKING:
    import torch

#: MoE fields of the model config, with the value a checkpoint without them means (dense).
MOE_KEYS: dict[str, Any] = {"n_experts": 0, "top_k": 2, "n_shared_experts": 0, "moe_every": 1, "moe_ffn_dim": 0,
                            "capacity_factor": 0.0, "router_z_loss_coef": 0.0, "load_balance_coef": 0.0}

_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_GATE = re.compile(r"layers\.(\d+)\.feed_forward\.gate\.weight")


def is_moe(cfg: dict[str, Any]) -> bool:
    """Whether the model config describes a mixture-of-experts model."""
    return int(cfg.get("n_experts") or 0) > 0


def mixtral_problem(cfg: dict[str, Any]) -> str | None:
    """What keeps a MoE model config from being a Mixtral (one line with the fix), or None."""
    if int(cfg.get("n_shared_experts") or 0):
        return (f"the model has shared experts (n_shared_experts = {cfg['n_shared_experts']}), which Mixtral "
                "has not; export with --format safetensors instead")
    if int(cfg.get("moe_every") or 1) != 1:
        return (f"the model mixes dense and MoE blocks (moe_every = {cfg['moe_every']}); Mixtral's blocks are all "
                "MoE; export with --format safetensors instead")
    return None


def expert_width(cfg: dict[str, Any]) -> int:
    """One expert's hidden width (``moe_ffn_dim``, 0 = ``ffn_dim``)."""
    return int(cfg.get("moe_ffn_dim") or 0) or int(cfg["ffn_dim"])


def moe_layer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Trainer name -> shape of one MoE block's MLP parameters (relative to ``layers.N.``)."""
    e, d, h = int(cfg["n_experts"]), int(cfg["dim"]), expert_width(cfg)
    return {"feed_forward.gate.weight": (e, d), "feed_forward.experts.w1": (e, d, h),
            "feed_forward.experts.w3": (e, d, h), "feed_forward.experts.w2": (e, h, d)}


def _take_expert(w: torch.Tensor, index: int) -> torch.Tensor:
    return w[index].t().contiguous()


def mixtral_tensors(fqn: str, shape: tuple[int, ...]) -> list[tuple[str, Any, tuple[int, ...] | None]]:
    """The Mixtral tensors of one trainer array: ``(name, transform or None, output shape or None)``.

    A stacked expert array gives one tensor per expert (that expert's slice, transposed); the
    router and every dense parameter give one, named as ``mapping.hf_name`` (plus the gate).

    Raises:
        ValueError: ``fqn`` has no Mixtral counterpart.
    """
    import functools

    m = _EXPERTS.fullmatch(fqn)
    if m:
        layer, proj = m.groups()
        return [(f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}.weight",
                 functools.partial(_take_expert, index=e), (shape[2], shape[1])) for e in range(shape[0])]
    g = _GATE.fullmatch(fqn)
    if g:
        return [(f"model.layers.{g.group(1)}.block_sparse_moe.gate.weight", None, None)]
    return [(hf_name(fqn), None, None)]


def mixtral_config(cfg: dict[str, Any], *, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a ``MixtralForCausalLM`` equal to the trainer's MoE GPT of ``cfg``.

    Args:
        cfg: the trainer's model config (``mapping.CONFIG_KEYS`` and :data:`MOE_KEYS`).
        dtype: the tensors' dtype name.

    Returns:
        The config as a JSON-able dict (``marind_model_config`` keeps the trainer's own).
    """
    out = hf_config(cfg, dtype=dtype)
    for key in ("mlp_bias", "attention_bias"):
        out.pop(key)
    out |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": expert_width(cfg),
            "num_local_experts": int(cfg["n_experts"]), "num_experts_per_tok": int(cfg["top_k"]),
            "output_router_logits": False, "router_aux_loss_coef": float(cfg.get("load_balance_coef") or 0.0),
            "router_jitter_noise": 0.0, "sliding_window": None,
            "marind_model_config": {**out["marind_model_config"], **{k: cfg.get(k, v) for k, v in MOE_KEYS.items()}}}
    return out

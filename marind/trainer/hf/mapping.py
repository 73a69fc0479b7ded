"""The trainer's GPT as a Hugging Face ``LlamaForCausalLM``: config, parameter names, rotary layout.

Pure functions over plain data, used by ``marind ckpt export --format hf`` (trainer -> HF)
and by ``[model] init_from`` (HF -> trainer). The GPT of ``marind.trainer.model.gpt`` is a
Llama without grouped-query attention: RMSNorm (weight x normalized, no bias), SwiGLU MLP
(``w2(silu(w1 x) * w3 x)``), no biases anywhere, rotary embeddings with inverse
frequencies ``theta ** (-2i / head_dim)``, tied or untied embeddings. One difference:
the trainer rotates interleaved pairs ``(2i, 2i+1)`` of a head, Llama rotates
``(i, i + head_dim/2)`` (``rotate_half``). The export permutes the rows of ``wq`` and
``wk`` within each head so the rotated pairs line up; attention scores are unchanged
because q and k get the same permutation. ``init_from`` applies the inverse.

Names (``N`` = layer)::

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.N.attention_norm.weight         model.layers.N.input_layernorm.weight
    layers.N.attention.w{q,k,v,o}.weight   model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.ffn_norm.weight               model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1.weight        model.layers.N.mlp.gate_proj.weight
    layers.N.feed_forward.w3.weight        model.layers.N.mlp.up_proj.weight
    layers.N.feed_forward.w2.weight        model.layers.N.mlp.down_proj.weight
    norm.weight                            model.norm.weight
    output.weight                          lm_head.weight   (absent with tied embeddings)
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:    # only tensors' methods are used: importing this module stays cheap (submit)
    import torch

#: ModelConfig fields a checkpoint's ``extra/model_config`` holds.
CONFIG_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "seq_len", "tie_embeddings",
               "norm_eps", "rope_theta")

_FIXED = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_FIXED_BACK = {v: k for k, v in _FIXED.items()}
_ROTARY = ("attention.wq.weight", "attention.wk.weight")


def hf_name(fqn: str) -> str:
    """The Llama name of a trainer parameter (``layers.0.attention.wq.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``).

    Raises:
        ValueError: ``fqn`` is no parameter of the trainer's GPT.
    """
    if fqn in _FIXED:
        return _FIXED[fqn]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", fqn)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"{fqn!r} is not a parameter of the trainer's GPT (marind.trainer.model.gpt); "
                     "export its arrays with --format safetensors instead")


def trainer_name(name: str) -> str:
    """The trainer's name of a Llama parameter (the inverse of :func:`hf_name`).

    Raises:
        ValueError: ``name`` has no counterpart in the trainer's GPT (e.g. a bias).
    """
    if name in _FIXED_BACK:
        return _FIXED_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_BACK:
        return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"
    raise ValueError(f"Hugging Face tensor {name!r} has no counterpart in the trainer's GPT "
                     "(a Llama without biases or grouped-query attention is supported)")


def needs_rotary_permute(fqn: str) -> bool:
    """Whether a trainer parameter's rows are rotary pairs (``wq``, ``wk``)."""
    return fqn.endswith(_ROTARY)


def to_hf_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of ``wq``/``wk`` from the trainer's interleaved pairs to Llama's half-split pairs.

    Within each head, output row ``j < d/2`` is input row ``2j`` and row ``d/2 + j`` is ``2j + 1``.
    """
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def from_hf_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_hf_rotary`."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, 2, d // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Trainer parameter name -> shape, for a model config (``CONFIG_KEYS``)."""
    v, d, f = int(cfg["vocab_size"]), int(cfg["dim"]), int(cfg["ffn_dim"])
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d), "norm.weight": (d,)}
    if not cfg["tie_embeddings"]:
        shapes["output.weight"] = (v, d)
    per_layer = {"attention_norm.weight": (d,), "ffn_norm.weight": (d,), "feed_forward.w1.weight": (f, d),
                 "feed_forward.w3.weight": (f, d), "feed_forward.w2.weight": (d, f)}
    per_layer |= {f"attention.w{x}.weight": (d, d) for x in "qkvo"}
    for n in range(int(cfg["n_layers"])):
        shapes |= {f"layers.{n}.{k}": s for k, s in per_layer.items()}
    return shapes


def shape_problems(cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What keeps ``shapes`` (trainer name -> shape) from being the model of ``cfg``: missing,
    unexpected and mis-shaped parameters, one entry each (empty: they match)."""
    want = expected_shapes(cfg)
    problems = [f"missing {n}" for n in sorted(set(want) - set(shapes))]
    problems += [f"unexpected {n}" for n in sorted(set(shapes) - set(want))]
    problems += [f"{n} has shape {list(shapes[n])}, the config needs {list(want[n])}"
                 for n in sorted(set(want) & set(shapes)) if tuple(shapes[n]) != want[n]]
    return problems


def hf_config(cfg: dict[str, Any], *, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to the trainer's GPT of ``cfg``.

    Both rotary spellings are written: ``rope_parameters`` (transformers 5) and ``rope_theta``
    (4.x). ``marind_model_config`` keeps the trainer's own config for ``init_from``.

    Args:
        cfg: the trainer's model config (``CONFIG_KEYS``).
        dtype: the tensors' dtype name (``torch_dtype``).

    Returns:
        The config as a JSON-able dict.
    """
    d, h = int(cfg["dim"]), int(cfg["n_heads"])
    theta = float(cfg["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": d,
        "intermediate_size": int(cfg["ffn_dim"]),
        "num_hidden_layers": int(cfg["n_layers"]),
        "num_attention_heads": h,
        "num_key_value_heads": h,
        "head_dim": d // h,
        "hidden_act": "silu",
        "max_position_embeddings": int(cfg["seq_len"]),
        "rms_norm_eps": float(cfg["norm_eps"]),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(cfg["tie_embeddings"]),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "marind_model_config": {k: cfg[k] for k in CONFIG_KEYS},
    }


def model_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The trainer's model config (``CONFIG_KEYS``) of a Llama ``config.json``.

    Raises:
        ValueError: the model is not one the trainer's GPT can hold (one line naming the key).
    """
    if hf.get("model_type") != "llama":
        raise ValueError(f"config.json has model_type {hf.get('model_type')!r}; only \"llama\" models load")
    h = int(hf["num_attention_heads"])
    d = int(hf["hidden_size"])
    checks = [
        ("num_key_value_heads", hf.get("num_key_value_heads", h), h, "grouped-query attention"),
        ("head_dim", hf.get("head_dim") or d // h, d // h, "a head width other than hidden_size / heads"),
        ("hidden_act", hf.get("hidden_act", "silu"), "silu", "another activation"),
        ("attention_bias", bool(hf.get("attention_bias", False)), False, "attention biases"),
        ("mlp_bias", bool(hf.get("mlp_bias", False)), False, "MLP biases"),
    ]
    for key, got, want, what in checks:
        if got != want:
            raise ValueError(f"config.json {key} = {got!r}: the trainer's GPT has no {what} (needs {want!r})")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json rope type {rope.get('rope_type', rope.get('type'))!r}: the trainer's "
                         "GPT has plain rotary embeddings only (rope_type \"default\")")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"vocab_size": int(hf["vocab_size"]), "dim": d, "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": h, "ffn_dim": int(hf["intermediate_size"]),
            "seq_len": int(hf.get("max_position_embeddings", 0)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": float(theta)}


def config_mismatch(model: dict[str, Any], hf_model: dict[str, Any]) -> str | None:
    """The first model key where the run's ``[model]`` and an ``init_from`` directory differ.

    ``seq_len`` may differ (rotary tables are built for the run); a ``vocab_size`` of None
    (taken from the data) is not compared.

    Returns:
        One line naming the key, both values and the fix, or None when they agree.
    """
    for key in CONFIG_KEYS:
        if key == "seq_len" or (key == "vocab_size" and model.get(key) is None):
            continue
        a, b = model.get(key), hf_model.get(key)
        same = abs(a - float(b)) <= 1e-9 * abs(a) if isinstance(a, float) and b is not None else a == b
        if not same:
            return (f"model.{key} = {a!r} but the init_from model has {b!r}; set model.{key} = {b!r} "
                    "(or start from another directory)")
    return None

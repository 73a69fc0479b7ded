"""Export a trainer checkpoint as a Hugging Face ``LlamaForCausalLM`` directory (a mixture-of-experts
model as a ``MixtralForCausalLM``: ``marind.trainer.hf.mixtral``).

Joins the generic sharded-safetensors writer (``ckpt_store.export.sharded``) with the
trainer's mapping (``marind.trainer.hf.mapping``). The model config comes from the
checkpoint's ``extra/model_config`` (saved by the trainer since this format was added);
an older checkpoint needs the run's ``--config run.toml``, whose ``[model]`` and
``data.seq_len`` give it (the vocabulary from the embedding's shape).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import torch

from ckpt_store.export import ExportTensor, export_sharded, read_values
from marind.trainer.hf.mapping import (
    CONFIG_KEYS,
    hf_config,
    hf_name,
    needs_rotary_permute,
    shape_problems,
    to_hf_rotary,
)
from marind.trainer.hf.mixtral import (
    MOE_KEYS,
    is_moe,
    mixtral_config,
    mixtral_problem,
    mixtral_tensors,
    moe_layer_shapes,
)

PREFIX = "model/"
#: the dtypes an export may write, by the name config.json gives them (``torch_dtype``)
_HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(store, step: int, manifest: dict, config_path: str | None) -> dict[str, Any]:
    """The trainer's model config of ``step``: the checkpoint's own, else ``config_path``'s.

    Args:
        store: the ``CheckpointStore``.
        step: the step.
        manifest: its manifest.
        config_path: the run's run.toml (or None).

    Returns:
        The config (``mapping.CONFIG_KEYS`` and ``mixtral.MOE_KEYS``, dense when absent).

    Raises:
        ValueError: neither source has it, or both have it and they differ (one line each).
    """
    saved = (read_values(store, step).get("extra") or {}).get("model_config")
    given = None
    if config_path:
        from marind.trainer.config import load_trainer_spec
        from marind.trainer.model.gpt import ModelConfig

        spec = load_trainer_spec(config_path, check_worlds=False)
        emb = manifest["arrays"].get(PREFIX + "tok_embeddings.weight")
        vocab = int(emb["shape"][0]) if emb else 0
        given = dataclasses.asdict(ModelConfig.from_spec(spec.model, seq_len=spec.data.seq_len,
                                                         data_vocab_size=vocab))
    if saved is None and given is None:
        raise ValueError(f"step {step} does not record its model config (saved before marind kept "
                         "extra/model_config); pass the run's spec with --config run.toml")
    if saved is not None and given is not None:
        diff = [k for k in CONFIG_KEYS if saved.get(k) != given.get(k)]
        if diff:
            raise ValueError(f"--config's model differs from the one saved in step {step} "
                             f"({diff[0]}: {given.get(diff[0])!r} vs {saved.get(diff[0])!r}); "
                             "drop --config to use the checkpoint's")
    cfg = saved if saved is not None else given
    assert cfg is not None
    return {k: cfg[k] for k in CONFIG_KEYS} | {k: cfg.get(k, v) for k, v in MOE_KEYS.items()}


def export_plan(manifest: dict, cfg: dict[str, Any]) -> list[ExportTensor]:
    """The tensors of a Llama export of a trainer checkpoint, in the trainer's layer order.

    Raises:
        ValueError: the checkpoint's ``model/`` arrays are not the model ``cfg`` describes (or a
            mixture-of-experts model's, which has no Llama layout).
    """
    shapes = {n[len(PREFIX):]: tuple(a["shape"]) for n, a in manifest["arrays"].items() if n.startswith(PREFIX)}
    moe = is_moe(cfg)
    if not moe and any(".feed_forward.experts." in fqn for fqn in shapes):
        raise ValueError("the checkpoint holds a mixture-of-experts model (feed_forward.experts arrays) but its "
                         "model config is dense; export with --format safetensors instead")
    if moe and (problem := mixtral_problem(cfg)):
        raise ValueError(problem)
    problems = shape_problems(cfg, shapes) if not moe else _moe_shape_problems(cfg, shapes)
    if problems:
        raise ValueError(f"the checkpoint's model arrays do not match its model config ({len(problems)} "
                         f"problems: {'; '.join(problems[:4])}); export with --format safetensors instead")
    permute = functools.partial(to_hf_rotary, n_heads=int(cfg["n_heads"]))

    def order(fqn: str) -> tuple:
        parts = fqn.split(".")
        return (1, int(parts[1]), fqn) if parts[0] == "layers" else (0 if fqn.startswith("tok") else 2, 0, fqn)
    if not moe:
        return [ExportTensor(PREFIX + fqn, hf_name(fqn), permute if needs_rotary_permute(fqn) else None)
                for fqn in sorted(shapes, key=order)]
    return [ExportTensor(PREFIX + fqn, name, permute if needs_rotary_permute(fqn) else fn, shape)
            for fqn in sorted(shapes, key=order) for name, fn, shape in mixtral_tensors(fqn, shapes[fqn])]


def _moe_shape_problems(cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """``shape_problems`` for a MoE model: the dense MLP of each block replaced by the router and experts."""
    dense_mlp = {k: s for k, s in shapes.items() if ".feed_forward." not in k}
    problems = [p for p in shape_problems(cfg, dense_mlp) if ".feed_forward." not in p]
    want = {f"layers.{n}.{k}": s for n in range(int(cfg["n_layers"])) for k, s in moe_layer_shapes(cfg).items()}
    got = {k: s for k, s in shapes.items() if ".feed_forward." in k}
    problems += [f"missing {n}" for n in sorted(set(want) - set(got))]
    problems += [f"unexpected {n}" for n in sorted(set(got) - set(want))]
    problems += [f"{n} has shape {list(got[n])}, the config needs {list(want[n])}"
                 for n in sorted(set(want) & set(got)) if tuple(got[n]) != want[n]]
    return problems


def export_hf(store, step: int, out: str, *, config_path: str | None = None, max_shard_bytes: int = 2 * 10**9,
              dtype: str | None = None, tokenizer: str | None = None,
              progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Write ``step`` of a trainer checkpoint to ``out`` as a Hugging Face Llama directory.

    Args:
        store: the ``CheckpointStore``.
        step: a committed step.
        out: the directory to create.
        config_path: the run's run.toml, for checkpoints without ``extra/model_config``.
        max_shard_bytes: the safetensors shard size limit.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the weights are cast to it as they are
            written and ``config.json`` says so; None keeps the saved dtype (float32 when the
            saved dtypes are mixed).
        tokenizer: a Hugging Face ``tokenizer.json`` (the one ``marind data prepare --tokenizer``
            took) copied into ``out`` with a ``tokenizer_config.json``, so that
            ``AutoTokenizer.from_pretrained(out)`` works; its vocabulary must fit the model's.
        progress: ``export_sharded``'s progress callback.

    Returns:
        ``export_sharded``'s summary.

    Raises:
        ValueError: no model config, arrays that do not match it, or a bad ``out``.
        SpecError: ``config_path`` is not a valid spec.
    """
    from ckpt_store.export import check_output_dir

    check_output_dir(out)
    manifest = store.manifest(step)
    cfg = model_config(store, step, manifest, config_path)
    plan = export_plan(manifest, cfg)
    if dtype is not None and dtype not in _HF_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_HF_DTYPES)}; pick one of them")
    if dtype is None:
        dtypes = {manifest["arrays"][t.array]["dtype"] for t in plan}
        dtype = dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in _HF_DTYPES else "float32"
    config = mixtral_config(cfg, dtype=dtype) if is_moe(cfg) else hf_config(cfg, dtype=dtype)
    files = {"config.json": config, **(tokenizer_files(tokenizer, cfg["vocab_size"]) if tokenizer else {})}
    return export_sharded(store, step, out, plan, files=files,
                          max_shard_bytes=max_shard_bytes, dtype=_HF_DTYPES[dtype], progress=progress)


def tokenizer_files(path: str, vocab_size: int) -> dict[str, dict]:
    """``tokenizer.json`` and a ``tokenizer_config.json`` for an export, from a tokenizer file.

    Args:
        path: a Hugging Face ``tokenizers`` JSON file.
        vocab_size: the model's vocabulary; the tokenizer's must not exceed it.

    Returns:
        File name -> JSON document, for ``export_sharded(files=...)``.

    Raises:
        ValueError: the file is missing, not a tokenizer, or its vocabulary is larger than the model's.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from exc
    try:
        with open(path) as f:
            doc = json.load(f)
        size = Tokenizer.from_str(json.dumps(doc)).get_vocab_size()
    except Exception as exc:  # noqa: BLE001 - a missing file, bad JSON, or tokenizers' own exception type
        raise ValueError(f"--tokenizer {path}: not a readable Hugging Face tokenizer.json ({exc}); "
                         "pass the file `marind data prepare --tokenizer` used") from None
    if size > vocab_size:
        raise ValueError(f"--tokenizer {path} has {size} tokens but the model's vocabulary is {vocab_size}; "
                         "pass the tokenizer the training data was prepared with")
    return {"tokenizer.json": doc,
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}}

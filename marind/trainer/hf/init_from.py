"""``[model] init_from``: start training from a Hugging Face Llama directory (fine-tuning).

The run's freshly built (and parallelized) model takes the directory's safetensors
weights, mapped back to the trainer's names and rotary layout
(``marind.trainer.hf.mapping``), before the first step, and only when the run has no
checkpoint to restore: a resumed run continues from its checkpoint instead. Every rank
reads the whole file set (safetensors, never pickle) and keeps its own shards
(``set_model_state_dict`` with full state dicts); the optimizer starts fresh.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from marind.trainer.hf.mapping import (
    config_mismatch,
    from_hf_rotary,
    model_config_from_hf,
    needs_rotary_permute,
    shape_problems,
    trainer_name,
)


class InitFromError(ValueError):
    """An ``init_from`` directory that cannot start this model (one line naming the fix)."""


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory (from the index, else ``model.safetensors``).

    Raises:
        InitFromError: neither the index nor ``model.safetensors`` is there.
    """
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    raise InitFromError(f"model.init_from: {path} has no model.safetensors or model.safetensors.index.json")


def read_hf_state(path: str | Path, model_cfg: dict) -> dict[str, torch.Tensor]:
    """The trainer's full state dict (names, rotary layout) read from a Hugging Face directory.

    Args:
        path: the directory.
        model_cfg: the run's model config (``mapping.CONFIG_KEYS``).

    Returns:
        Trainer parameter name -> full tensor (CPU).

    Raises:
        InitFromError: the directory's config or tensors do not fit the model (every problem named).
    """
    from safetensors import safe_open

    try:
        hf = model_config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InitFromError(f"model.init_from: cannot use {path}/config.json ({exc}); "
                            "point init_from at a Llama model directory") from exc
    mismatch = config_mismatch(model_cfg, hf)
    if mismatch:
        raise InitFromError(f"model.init_from: {path}: {mismatch}")
    n_heads = int(model_cfg["n_heads"])
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model_cfg["tie_embeddings"]:
                    continue          # a tied model saved with its head: the embedding is the head
                try:
                    fqn = trainer_name(name)
                except ValueError as exc:
                    raise InitFromError(f"model.init_from: {exc}") from None
                t = f.get_tensor(name)
                state[fqn] = from_hf_rotary(t, n_heads) if needs_rotary_permute(fqn) else t
    problems = shape_problems(model_cfg, {k: tuple(v.shape) for k, v in state.items()})
    if problems:
        raise InitFromError(f"model.init_from: {path} does not fit [model] ({len(problems)} problems: "
                            f"{'; '.join(problems[:5])}); export the directory again from a matching run")
    return state


def load_init_from(model: torch.nn.Module, path: str | Path, model_cfg: dict) -> int:
    """Fill ``model`` (any FSDP2/TP layout) with the weights of a Hugging Face directory.

    Collective when the model is distributed: every rank calls it.

    Args:
        model: the freshly built, parallelized model.
        path: the directory (``model.init_from``).
        model_cfg: the run's model config (``mapping.CONFIG_KEYS``).

    Returns:
        The number of tensors loaded.

    Raises:
        InitFromError: see :func:`read_hf_state`.
    """
    state = read_hf_state(path, model_cfg)
    # named as in a state dict (activation checkpointing's wrapper is not part of the FQN)
    dtypes = {n.replace("_checkpoint_wrapped_module.", ""): p.dtype for n, p in model.named_parameters()}
    full: dict[str, Any] = {k: v.to(dtypes[k]) if k in dtypes else v for k, v in state.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))
    return len(state)


def init_run_from(run) -> bool:
    """Load ``[model] init_from`` into ``run.model`` when it is set (the run restored nothing).

    Args:
        run: the ``marind.trainer.build.Run`` before its first step.

    Returns:
        Whether weights were loaded.

    Raises:
        InitFromError: see :func:`read_hf_state`.
    """
    path = run.spec.model.init_from
    if not path:
        return False
    n = load_init_from(run.model, path, dataclasses.asdict(run.cfg))
    if run.rank == 0:
        run.log.info("initialized_from", path=path, tensors=n)
    return True

"""``save_training_state`` / ``load_training_state``: model and optimizer state through the job's store.

Built on ``torch.distributed.checkpoint.state_dict``: ``get_state_dict`` turns a module
(plain, DDP, FSDP2, tensor parallel) and any torch optimizer into trees keyed by parameter
FQN (sharded DTensors stay sharded), and ``set_state_dict`` puts such trees back, so a
checkpoint restores into a different world size or mesh. The checkpoint's tree::

    model/{fqn}                    parameters and buffers
    optim/{fqn}/{state name}       the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq, step)
    extra/step                     the step saved
    extra/param_groups             the optimizer's hyperparameters, parameters by FQN
    extra/user/...                 the program's ``extra`` (JSON values and tensors)

Nothing saved is dropped on load, silently or otherwise: a fresh optimizer (Adam has no
state until its first step) gets its state slots first (a zero-lr step on zero gradients),
and a saved array the target has no place for, or a target array the checkpoint lacks,
fails the load with ``ckpt_store.CheckpointMismatch`` naming the keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from marind.worker.job_store import checkpoints
from marind.worker.reporting import default_reporter, set_phase
from marind.worker.stop import agree

_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)

#: (pid, store URL, step) of the step this process last saved or loaded: saving it again is a no-op.
_held: tuple[int, str, int] | None = None


def _note_held(url: str, step: int) -> None:
    global _held
    _held = (os.getpid(), url, step)


def _plain(value: Any) -> Any:
    """A param-group value as JSON (a one-element tensor becomes its number, a tuple a list)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def state_tree(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               extra: dict[str, Any] | None) -> dict[str, Any]:
    """The checkpoint tree of ``model`` and ``optimizer`` (see the module docstring).

    Args:
        model: the module (plain, DDP, FSDP2, ...).
        optimizer: its optimizer.
        step: the step recorded.
        extra: the program's own state, kept by reference (a load fills it in place).

    Returns:
        The tree, its tensors those of the model and optimizer (no copies).
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    param_groups = cast(list[dict[str, Any]], optim_sd.get("param_groups", []))
    groups = [{k: _plain(v) for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
              for g in param_groups]
    return {"model": model_sd, "optim": optim_sd.get("state", {}),
            "extra": {"step": step, "param_groups": groups, "user": extra if extra is not None else {}}}


def tensor_names(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """The checkpoint names (``a/b/c``) of the tensors in ``tree``."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name
        elif isinstance(value, dict):
            yield from tensor_names(value, name + "/")


def dropped_arrays(saved: set[str], target: set[str]) -> list[str]:
    """Saved arrays a load into ``target`` would leave behind, each with the reason.

    Args:
        saved: the array names of the checkpoint (its manifest's ``arrays``).
        target: the tensor names of the target tree.

    Returns:
        One problem line per dropped array, sorted (empty: nothing is dropped).
    """
    return [f"{name}: saved, but the target has no place for it (it would be dropped)"
            for name in sorted(saved - target)]


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give every parameter without optimizer state its state slots (a zero-lr step on zero gradients).

    Parameters that already have state, and their gradients, are left as they are.

    Args:
        optimizer: any torch optimizer.

    Returns:
        The parameters that got state (their state can be removed again with
        ``optimizer.state.pop(p)``).
    """
    fresh = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not fresh:
        return []
    fresh_ids = {id(p) for p in fresh}
    kept: dict[int, torch.Tensor | None] = {}
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            kept[id(p)] = p.grad
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = kept[id(p)]
    return [p for p in fresh if p in optimizer.state]


def save_training_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        extra: dict[str, Any] | None = None) -> None:
    """Save ``step``'s model and optimizer state (and ``extra``) to the job's store; returns once committed.

    Collective: every rank calls it at the same step. The progress record shows phase
    ``checkpointing`` meanwhile and the step as ``last_checkpoint_step`` after. Saving the
    step this process last saved or loaded again is a no-op (a periodic save and a save on
    stop may fall on one step).

    Args:
        step: the step the state is of (what :func:`load_training_state` returns).
        model: the module (plain, DDP, FSDP2, ...).
        optimizer: its optimizer (any torch optimizer).
        extra: the program's own state: JSON values and tensors (e.g. a data position,
            an LR scheduler's ``state_dict()`` of numbers).

    Raises:
        marind.worker.NoCheckpoints: the job has no ``[checkpoint] url``.
        ckpt_store.CheckpointSaveFailed: the checkpoint did not commit.
        ValueError: ``extra`` holds something neither a tensor nor JSON-able.
    """
    store = checkpoints()
    if _held == (os.getpid(), store.url, step):
        return
    set_phase("checkpointing")
    pending = store.save(step, state_tree(model, optimizer, step, extra), async_=False)
    pending.wait()
    _note_held(store.url, step)
    set_phase("training", last_checkpoint_step=step)


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        extra: dict[str, Any] | None = None) -> int | None:
    """Load the latest committed checkpoint into ``model``, ``optimizer`` and ``extra``.

    Collective: every rank calls it. Call it after building the model and optimizer and
    before the first step; a fresh optimizer is given its state slots first, so its state
    is restored in full. A corrupt latest step is skipped for the one before it.

    Args:
        model: the module, as it was saved (parameters by FQN).
        optimizer: its optimizer, of the same kind and parameter groups as saved.
        extra: filled in place with the saved ``extra`` (tensors in it must be present,
            with the saved shapes; JSON values are added).

    Returns:
        The step loaded, or None when the store holds no checkpoint yet (a first start;
        nothing is changed).

    Raises:
        marind.worker.NoCheckpoints: the job has no ``[checkpoint] url``.
        ckpt_store.CheckpointMismatch: the checkpoint does not fit the target: a target
            tensor it lacks, a shape or dtype that differs, or saved state the target has
            no place for (every key is named).
        ckpt_store.CheckpointError: the checkpoint cannot be read.
    """
    from ckpt_store import CheckpointMismatch, CheckpointNotFound

    store = checkpoints()
    latest = store.latest()
    if not agree(latest is not None):
        return None
    set_phase("restoring")
    fresh = init_optimizer_state(optimizer)
    state = state_tree(model, optimizer, -1, extra)
    names = set(tensor_names(state))

    def check(step: int) -> None:
        problems = dropped_arrays(set(store.manifest(step)["arrays"]), names)
        if problems:
            raise CheckpointMismatch(step, problems)

    if latest is not None:
        check(latest)      # before anything is loaded (the step loaded below is checked too)
    try:
        store.load(state)
    except CheckpointNotFound:
        for p in fresh:   # nothing loaded after all: the optimizer is fresh again
            optimizer.state.pop(p, None)
        set_phase("training")
        return None
    step = int(state["extra"]["step"])
    if step != latest:
        check(step)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": state["extra"]["param_groups"]},
                   options=_OPTIONS)
    _note_held(store.url, step)
    set_phase("training", step=step, last_checkpoint_step=step)
    reporter = default_reporter()
    if reporter is not None:
        reporter.mark()
    return step

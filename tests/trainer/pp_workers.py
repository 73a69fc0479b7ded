"""Functions run on real gloo ranks by the pipeline tests (``run_torch_workers``)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from marind.core.workerenv import WorkerEnv
from marind.distributed import device_for_local_rank
from marind.trainer.build import setup_run
from marind.trainer.config import TrainerSpec
from marind.trainer.loop import LoopState, StopFlag, run_loop
from marind.trainer.train import ElasticMode
from tests.trainer.workers import _digest


def full_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of this rank's full (unsharded) parameters and optimizer state, by global name."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": _digest(v) for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        for name, v in st.items():
            out[f"optim/{fqn}/{name}"] = _digest(v if isinstance(v, torch.Tensor) else torch.tensor(v))
    return out


def resume_and_digest(spec: dict) -> dict:
    """Restore the latest checkpoint, digest the restored state, then train to ``train.steps``."""
    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    mode = ElasticMode()
    run = setup_run(typed, device_for_local_rank(), WorkerEnv.from_environ(), mode)
    state = LoopState()
    mode.start(run, state)
    restored = {"step": state.step, "position": state.position,
                "digests": full_digests(run.model, run.optimizer)}
    result = run_loop(run, mode, StopFlag())   # restores the same step again, then trains
    return {**result.as_dict(), "restored": restored, "digests": full_digests(run.model, run.optimizer)}

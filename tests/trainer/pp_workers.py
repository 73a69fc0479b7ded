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


def pp_clip_collectives(spec: dict) -> dict:
    """One pipelined forward/backward, then ``clip_grad_norm`` under ``CommDebugMode``: its collectives
    and norm, beside the reference (each gradient's ``full_tensor()`` norm, summed over the stages)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from marind.trainer.build import build
    from marind.trainer.parallel.grad_norm import clip_grad_norm

    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    b = build(typed, device_for_local_rank())
    assert b.pipeline is not None
    lay = b.layout
    b.pipeline.forward_backward(lambda k: b.sampler.batch([lay.dp_rank + k * lay.dp_size], torch.device("cpu")),
                                step=0)
    params = list(b.model.parameters())
    ref = torch.zeros(())
    for p in params:
        sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
        ref = ref + (sq.full_tensor() if isinstance(sq, DTensor) else sq)
    dist.all_reduce(ref, group=b.pipeline.world_mesh["pp"].get_group())
    names = {p.grad.device_mesh.mesh_dim_names for p in params if isinstance(p.grad, DTensor)}
    pp_mesh = b.pipeline.world_mesh
    with CommDebugMode() as comm:
        norm = clip_grad_norm(params, 1.0, pp_mesh=pp_mesh)   # first call: may create the flattened groups
    with CommDebugMode() as comm2:
        clip_grad_norm(params, 1.0, pp_mesh=pp_mesh)
    return {"norm": float(norm), "ref": float(ref.sqrt()), "meshes": len(names), "params": len(params),
            "counts": {str(k): v for k, v in comm.get_comm_counts().items()},
            "counts2": {str(k): v for k, v in comm2.get_comm_counts().items()}}


def step_grad_norms(spec: dict) -> dict[str, float]:
    """One step's accumulated gradients (the loop's micro-batches, or the pipeline's schedule) without
    clipping or update: the norm of each full gradient this rank holds, by global parameter name."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    from marind.trainer.build import build
    from marind.trainer.config import grad_accum_steps
    from marind.trainer.loop import _forward_backward

    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    b = build(typed, device_for_local_rank())
    lay = b.layout
    run = SimpleNamespace(sampler=b.sampler, device=torch.device("cpu"), model=b.model,
                          accum=grad_accum_steps(typed, lay.dp_size))
    mode = SimpleNamespace(sample_indices=lambda _run, _state, k: [lay.dp_rank + k * lay.dp_size])
    if b.pipeline is not None:
        b.pipeline.forward_backward(lambda k: run.sampler.batch(mode.sample_indices(run, None, k), run.device),
                                    step=0)
    else:
        _forward_backward(run, mode, None)   # type: ignore[arg-type]
    out = {}
    for name, p in b.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = float(g.norm())
    return out

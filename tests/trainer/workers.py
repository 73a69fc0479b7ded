"""Functions run on real gloo ranks by ``run_torch_workers`` in the trainer tests, and the reshard
check the layout tests share (:func:`check_reshard`, run in the test process)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from marind.distributed import device_for_local_rank
from marind.trainer.config import TrainerSpec
from marind.trainer.train import train


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def train_and_digest(spec: dict) -> dict:
    """Train; return the result plus a digest of every full parameter and optimizer tensor."""
    result, model, optimizer = train(TrainerSpec.from_dict(spec, check_worlds=False), device_for_local_rank())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    digests = {f"model/{k}": _digest(v) for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        for name, v in st.items():
            digests[f"optim/{fqn}/{name}"] = _digest(v if isinstance(v, torch.Tensor) else torch.tensor(v))
    return {**result.as_dict(), "digests": digests}


def init_and_save(spec: dict) -> dict:
    """Build the run, start it (restore or ``[model] init_from``), save step 0 without training."""
    from marind.core.workerenv import WorkerEnv
    from marind.trainer.build import setup_run
    from marind.trainer.loop import LoopState
    from marind.trainer.train import ElasticMode

    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    mode = ElasticMode()
    run = setup_run(typed, device_for_local_rank(), WorkerEnv.from_environ(), mode)
    state = LoopState()
    mode.start(run, state)
    run.ckpt.save(state.step, state.position, wait=True)
    model_sd = get_state_dict(run.model, run.optimizer, options=StateDictOptions(full_state_dict=True))[0]
    return {"step": state.step, "digests": {k: _digest(v) for k, v in model_sd.items()}}


def clip_collectives(spec: dict) -> dict:
    """One forward/backward, then ``clip_grad_norm`` under ``CommDebugMode``: its collectives and norm.

    Also the reference norm of the old way (``full_tensor()`` of each gradient's norm, summed).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from marind.trainer.build import build
    from marind.trainer.model.gpt import lm_loss
    from marind.trainer.parallel.grad_norm import clip_grad_norm

    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    b = build(typed, device_for_local_rank())
    x, y = b.sampler.batch(list(range(b.layout.dp_rank, 2 * b.layout.dp_size, b.layout.dp_size)), x_device := torch.device("cpu"))
    lm_loss(b.model(x.to(x_device)), y).backward()
    params = list(b.model.parameters())
    ref = torch.zeros(())
    for p in params:
        sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
        ref = ref + (sq.full_tensor() if isinstance(sq, DTensor) else sq)
    meshes = {p.grad.device_mesh for p in params if isinstance(p.grad, DTensor) and p.grad.device_mesh.size() > 1}
    with CommDebugMode() as comm:
        norm = clip_grad_norm(params, 1.0)   # first call: may create the flattened mesh group
    with CommDebugMode() as comm2:
        clip_grad_norm(params, 1.0)
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    counts2 = {str(k): v for k, v in comm2.get_comm_counts().items()}
    return {"norm": float(norm), "ref": float(ref.sqrt()), "meshes": len(meshes), "params": len(params),
            "counts": counts, "counts2": counts2}


def initial_digests(spec: dict) -> dict:
    """Build the model (meta, parallelize, materialize, init) and digest its full state dict."""
    from marind.trainer.build import build

    b = build(TrainerSpec.from_dict(spec, check_worlds=False), device_for_local_rank())
    model_sd = get_state_dict(b.model, b.optimizer, options=StateDictOptions(full_state_dict=True))[0]
    return {"digests": {k: _digest(v) for k, v in model_sd.items()},
            "rope": _digest(b.model.rope_cos) + _digest(b.model.rope_sin)}


def _vm_hwm() -> int:
    """Peak resident memory of this process in bytes (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build_peak_memory(spec: dict) -> dict:
    """Peak RSS before and after ``build`` (model only: no step, so no optimizer state)."""
    import torch.distributed as dist

    from marind.trainer.build import build

    dist.barrier()
    before = _vm_hwm()
    b = build(TrainerSpec.from_dict(spec, check_worlds=False), device_for_local_rank())
    after = _vm_hwm()
    local = sum(p.to_local().numel() * p.element_size() for p in b.model.parameters())
    full = sum(p.numel() * p.element_size() for p in b.model.parameters())
    largest = max(p.numel() * p.element_size() for p in b.model.parameters())
    return {"before": before, "after": after, "local_bytes": local, "full_bytes": full, "largest_bytes": largest}


def _full_digests(model, optimizer) -> dict[str, str]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    digests = {f"model/{k}": _digest(v) for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        for name, v in st.items():
            digests[f"optim/{fqn}/{name}"] = _digest(v if isinstance(v, torch.Tensor) else torch.tensor(v))
    return digests


def train_moe(spec: dict) -> dict:
    """Train, recording each step's router statistics."""
    from marind.core.workerenv import WorkerEnv
    from marind.trainer.build import setup_run
    from marind.trainer.loop import run_loop
    from marind.trainer.train import ElasticMode
    from marind.worker.stop import StopFlag

    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    routers: list[dict] = []

    class Recording(ElasticMode):
        def report_step(self, run, state, report):
            super().report_step(run, state, report)
            routers.append(report.router)

    mode = Recording()
    run = setup_run(typed, device_for_local_rank(), WorkerEnv.from_environ(), mode)
    result = run_loop(run, mode, StopFlag())
    return {**result.as_dict(), "digests": _full_digests(run.model, run.optimizer), "routers": routers}


def saved_arrays(url: str, step: int) -> dict[str, str]:
    """Digests of every array of checkpoint ``step`` read straight from the store (as one process)."""
    from ckpt_store import CheckpointStore
    from ckpt_store.format.zarr_format import TORCH_DTYPES, ArraySpec

    store = CheckpointStore(url)
    try:
        state: dict = {}
        names = []
        for name, meta in store.manifest(step)["arrays"].items():
            spec = ArraySpec.from_json(name, meta)
            node = state
            *tables, leaf = name.split("/")
            for key in tables:
                node = node.setdefault(key, {})
            node[leaf] = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
            names.append(name)
        store.load_arrays(state, step)
        out = {}
        for name in names:
            node = state
            for key in name.split("/"):
                node = node[key]
            out[name] = _digest(node)
        return out
    finally:
        store.close()


def check_reshard(resume: Callable[[str], list[dict]], src_ckpt: str | Path, dst: Path, step: int, *,
                  position: int, want_losses: list[float], holds: Iterable[str] = ()) -> list[dict]:
    """Resume checkpoint ``step`` of ``src_ckpt`` in another layout and compare (in the test process).

    The step's directory is copied into ``dst`` (so the resumed run writes its own checkpoints
    there); every rank of the resumed run restores ``step`` and ``position``; the parameters and
    optimizer state it restored (the union over its ranks) are the saved global arrays, bit for
    bit; and its losses continue ``want_losses`` (the uninterrupted run's after ``step``) within
    float reduction noise (relative 1e-4).

    Args:
        resume: runs the resumed job on the checkpoint directory it is given and returns its ranks'
            results (``tests.trainer.pp_workers:resume_and_digest``), rank 0 first.
        src_ckpt: the saving run's checkpoint directory.
        dst: an empty directory for the copy.
        step: the checkpoint step.
        position: the data position that step holds.
        want_losses: the losses the resumed run must reproduce.
        holds: array names the checkpoint must have (``model/...``, ``optim/.../exp_avg``).

    Returns:
        The resumed run's results.
    """
    step_dir = f"step-{step:010d}"
    shutil.copytree(Path(src_ckpt) / step_dir, dst / step_dir)
    arrays = {k: v for k, v in saved_arrays(f"file://{dst}", step).items() if k.startswith(("model/", "optim/"))}
    missing = set(holds) - set(arrays)
    assert not missing, sorted(missing)
    resumed = resume(str(dst))
    restored: dict[str, str] = {}
    for res in resumed:
        assert (res["restored"]["step"], res["restored"]["position"]) == (step, position), res["restored"]
        for k, v in res["restored"]["digests"].items():
            assert restored.setdefault(k, v) == v, k   # ranks that hold the same array hold it alike
    assert restored == arrays, sorted(set(restored) ^ set(arrays))[:5]
    got = resumed[0]["losses"]
    assert len(got) == len(want_losses), (got, want_losses)
    assert all(abs(g - w) <= 1e-4 * abs(w) for g, w in zip(got, want_losses)), (got, want_losses)
    return resumed


def train_with_commits_held(spec: dict, run_root: str, held_rank: int | None) -> dict:
    """Train under a fake agent run directory per rank whose lease file fences commits on
    ``held_rank`` only (None: on no rank); rank 0 returns the committed steps."""
    import os
    import time

    from ckpt_store import CheckpointStore
    from marind.core.lease_file import write_lease
    from marind.core.workerenv import RUN_DIR

    rank = int(os.environ["RANK"])
    run_dir = Path(run_root) / f"rank-{rank}"
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    write_lease(run_dir, renewed_at=now + 3600, ttl=10, node=f"n{rank}",
                until=now - 1 if rank == held_rank else None)
    os.environ[RUN_DIR] = str(run_dir)
    typed = TrainerSpec.from_dict(spec, check_worlds=False)
    result, _, _ = train(typed, device_for_local_rank())
    steps = CheckpointStore(typed.checkpoint.url).steps() if rank == 0 else None
    return {"step": result.step, "steps": steps}

"""The CUDA/nccl path in one short run, for a machine with GPUs; ONE JSON object as the last line.

    python bench/gpu_check.py [--steps 20] [--nproc N]

Needs no etcd and no S3 (a lent GPU machine has neither). Checks, each
reported as ``{"ok": bool, ...}``:

* ``backend``: the device and backend the workers pick (cuda/nccl expected).
* ``train_warm``: the tiny trainer under ``torchrun --standalone`` with N ranks
  (default: every GPU, at most 2) on nccl, launched the way the agent does
  (the PDEATHSIG shim forks the zygote; torchrun runs ``marind.agent.warm_start.zygote_stub``),
  so the workers are forked from a process that imported torch and then use
  CUDA; async checkpoints to a local directory.
* ``resume``: the same spec run again with more steps resumes from the
  checkpoint (step count and a finite loss).
* ``ckpt_roundtrip``: ckpt_store saves CUDA tensors (pinned snapshot) and
  loads them back bit-exact into CUDA tensors.
* ``zygote_cuda_clean``: preloading the trainer does not initialise CUDA.
* ``moe``: the mixture-of-experts preset (``moe-tiny``) trains on the GPU(s): one rank
  (routing, capacity and the aux losses on CUDA); with two GPUs also expert parallel
  (``ep = 2``: the token all-to-all on nccl) and pipeline parallel (``pp = 2``, 1F1B:
  stage-to-stage sends on nccl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPEC = """
[job]
name = "gpu-check"
nodes = "1"
nproc_per_node = {nproc}
entrypoint = "marind.trainer"
[model]
preset = "tiny"
[data]
path = "{data}"
seq_len = 128
global_batch = 16
micro_batch = 2
[train]
steps = {steps}
log_every = 1
[checkpoint]
url = "file://{ckpt}"
every_steps = 5
async = true
{extra}"""

#: the ``moe`` check's layouts: name -> (ranks, spec tables appended to SPEC)
MOE_LAYOUTS = {
    "moe_single": (1, '[model]\npreset = "moe-tiny"\n'),
    "moe_ep2": (2, '[model]\npreset = "moe-tiny"\n[parallel]\nep = 2\n'),
    "moe_pp2": (2, '[model]\npreset = "moe-tiny"\ntie_embeddings = false\n[parallel]\npp = 2\n'
                   'pp_schedule = "1F1B"\npp_microbatches = 4\n'),
}


def _steps_in(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if '"event": "step"' in line and "{" in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                pass
    return out


def spec_text(nproc: int, steps: int, data: str, ckpt: Path, extra: str = "") -> str:
    """The check's run.toml: SPEC with ``extra`` tables (a later table's keys win: TOML tables
    may not repeat, so ``extra``'s ``[model]``/``[parallel]`` replace SPEC's)."""
    text = SPEC.format(nproc=nproc, data=data, steps=steps, ckpt=ckpt, extra="")
    if 'preset = "moe-tiny"' in extra:
        text = text.replace('[model]\npreset = "tiny"\n', "")
    return text + extra


def run_trainer(root: Path, nproc: int, steps: int, data: str, extra: str = "", name: str = "") -> dict:
    from marind.agent.supervisor import _PDEATHSIG_SHIM
    from marind.agent.torchrun_args import zygote_env
    from marind.trainer import MARIND_PRELOAD
    spec = root / f"spec-{name or steps}.toml"
    spec.write_text(spec_text(nproc, steps, data, root / f"ckpt{name}", extra))
    env = dict(os.environ, PYTHONPATH=str(REPO), MARIND_LOG_JSON="1", OMP_NUM_THREADS="1",
               **zygote_env("gpu-check", root, MARIND_PRELOAD))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()),
                          sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}", "-m", "marind.agent.warm_start.zygote_stub", "marind.trainer", str(spec)],
                         env=env, capture_output=True, text=True, timeout=900, cwd=root)
    text = res.stdout + res.stderr
    steps_seen = _steps_in(text)
    return {"rc": res.returncode, "wall_s": round(time.time() - t0, 1), "last_step": steps_seen[-1]["step"] if steps_seen else None,
            "last_loss": steps_seen[-1]["loss"] if steps_seen else None,
            "cold_starts": text.count("cold start"), "restored": '"event": "restored"' in text,
            "tail": text[-1500:] if res.returncode else ""}


def ckpt_roundtrip(root: Path) -> dict:
    import torch

    from ckpt_store import CheckpointStore
    dev = torch.device("cuda", 0)
    state = {"model": {"w": torch.randn(513, 77, device=dev), "b": torch.randn(3, device=dev).to(torch.bfloat16)},
             "extra": {"note": "gpu"}}
    store = CheckpointStore(f"file://{root}/rt")
    store.save(1, state, async_=True).wait()
    target = {"model": {"w": torch.zeros(513, 77, device=dev), "b": torch.zeros(3, device=dev, dtype=torch.bfloat16)},
              "extra": {}}
    store.load(target, step=1)
    same = all(torch.equal(state["model"][k], target["model"][k]) for k in ("w", "b"))
    # a bigger state grows the pinned snapshot arena: the old mapping is unpinned, the new one pinned
    bigger = {"model": {"w": torch.randn(4096, 1024, device=dev)}}
    store.save(2, bigger, async_=True).wait()
    back = {"model": {"w": torch.zeros(4096, 1024, device=dev)}}
    store.load(back, step=2)
    grown = torch.equal(bigger["model"]["w"], back["model"]["w"])
    verified = store.verify(1).ok and store.verify(2).ok
    store.close()
    return {"ok": same and grown and verified and target["model"]["w"].device.type == "cuda",
            "grown_arena_ok": grown}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs, at most 2)")
    args = parser.parse_args()
    import torch

    from marind.distributed import backend_for, device_for_local_rank
    result: dict = {"bench": "gpu_check", "torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpus": torch.cuda.device_count()}
    dev = device_for_local_rank()
    result["backend"] = {"ok": dev.type == "cuda" and backend_for(dev) == "nccl", "device": str(dev),
                         "backend": backend_for(dev)}
    import marind.agent.warm_start.zygote as zygote
    from marind.trainer import MARIND_PRELOAD
    zygote.preload(zygote.preload_names(",".join(MARIND_PRELOAD)))
    result["zygote_cuda_clean"] = {"ok": zygote.fork_unsafe_reason() is None}
    root = Path(tempfile.mkdtemp(prefix="marind-gpu-check-"))
    from marind.trainer.data import corpus
    corpus.write_example_dataset(root / "corpus", 60)
    nproc = args.nproc or max(1, min(2, torch.cuda.device_count()))
    first = run_trainer(root, nproc, args.steps, str(root / "corpus"))
    result["train_warm"] = {"ok": first["rc"] == 0 and first["last_step"] == args.steps and first["cold_starts"] == 0,
                            "nproc": nproc, **first}
    again = run_trainer(root, nproc, args.steps + 10, str(root / "corpus"))
    result["resume"] = {"ok": again["rc"] == 0 and again["restored"] and again["last_step"] == args.steps + 10,
                        **again}
    runs = {}
    for name, (ranks, extra) in MOE_LAYOUTS.items():
        if ranks <= torch.cuda.device_count():
            run = run_trainer(root, ranks, args.steps, str(root / "corpus"), extra=extra, name=name)
            runs[name] = {"rc": run["rc"], "last_step": run["last_step"], "last_loss": run["last_loss"],
                          "wall_s": run["wall_s"], "tail": run["tail"]}
    result["moe"] = {"ok": bool(runs) and all(r["rc"] == 0 and r["last_step"] == args.steps for r in runs.values()), **runs}
    try:
        result["ckpt_roundtrip"] = ckpt_roundtrip(root)
    except Exception as exc:  # noqa: BLE001 - report it with the rest
        result["ckpt_roundtrip"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["ok"] = all(v.get("ok") for v in result.values() if isinstance(v, dict))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

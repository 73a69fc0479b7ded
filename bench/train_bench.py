"""Trainer throughput and checkpoint overhead; ONE JSON object as the last stdout line.

* tokens/s and MFU of the ``tiny`` and ``125m`` presets at 1, 2 and 4 ranks
  (torchrun --standalone, gloo on CPU / nccl on GPU), from the trainer's own
  per-step log lines, warm-up steps dropped;
* async checkpointing every 10 steps versus none, same job otherwise (1 and 2 ranks):
  tokens/s = tokens / wall time of the measured steps (a step's time runs
  from the end of the previous step, so checkpoint stalls count), median
  over repeats; overhead in % of the no-checkpoint baseline (floor: <= 5 %);
* layouts (2 ranks, same model, untied embeddings): dense FSDP (``dp_shard = 2``) beside
  pipeline parallel (``pp = 2``: 1F1B, and in the full run GPipe and Interleaved1F1B):
  tokens/s, every rank's peak memory (list, max, min; CUDA allocated on a GPU, the RSS
  high-water mark on CPU) and the pipeline's bubble fraction twice: as its schedule sets it,
  ``(pp - 1) / (v microbatches + pp - 1)`` (``bubble_fraction``), and measured per rank as
  ``1 - busy / wall`` of the schedule runs after the warm-up steps (``bubble_measured``,
  its mean ``bubble_measured_mean``; ``marind.trainer.parallel.pipeline_timing``);
* mixture of experts (2 ranks): ``moe-tiny`` with expert parallelism (``dp_shard = 2, ep = 2``)
  beside the dense FSDP run (``dp_shard = 2``) of the same ACTIVE parameter count (the dense
  MLP's width matched to the router, ``top_k`` routed and shared experts one token uses), and
  (full run only) ``moe-tiny`` under ``pp = 2``: tokens/s, every rank's peak memory (and the
  measured bubble under ``pp``), parameters (total and active) and the router statistics of the
  measured steps (medians of the load spread, balance and z-losses; dropped assignments summed).

The per-rank figures come from each rank's final progress record (``metrics``: peak memory,
and the stage timing that ``MARIND_BENCH_PP_TIMING`` turns on), read from the run directory the
bench gives the job (``MARIND_RUN_DIR``).

``--quick`` runs a reduced matrix (tiny only, 1 rank, 1 repeat) so a test
can check the output shape; its figures mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPEC = """
[job]
name = "bench"
[model]
preset = "{preset}"
{model_extra}
[data]
path = "{data}"
seq_len = {seq_len}
global_batch = {global_batch}
micro_batch = {micro_batch}
[optim]
lr = 1e-3
warmup_steps = 2
[train]
steps = {steps}
log_every = 1
[checkpoint]
url = "{url}"
every_steps = {every}
async = true
keep_last = 2
"""

PRESETS = {  # preset -> (seq_len, global_batch, micro_batch, steps, warmup steps dropped)
    "tiny": (128, 16, 2, 30, 5),
    "125m": (128, 4, 1, 6, 2),
}


def run_job(preset: str, ranks: int, work: Path, data: str, *, ckpt_every: int = 0,
            steps: int | None = None, model_extra: str = "", model_preset: str = "", per_rank: bool = False) -> dict:
    """One torchrun job of ``preset``'s shape (``model_preset``: the ``[model] preset`` key, default ``preset``).

    ``per_rank``: every rank's peak memory and, under pipeline parallelism, its measured bubble
    (:func:`rank_figures`), from the ranks' final progress records (``MARIND_RUN_DIR``; without
    checkpoints, whose commits an agent's run directory would fence) with the stage timing on
    (``MARIND_BENCH_PP_TIMING``, the warm-up steps not timed).
    """
    seq_len, gb, mb, default_steps, drop = PRESETS[preset]
    steps = steps or default_steps
    if per_rank and ckpt_every:
        raise ValueError("per_rank figures come from a run without checkpoints")
    tag = f"{preset}-r{ranks}-c{ckpt_every}-{time.monotonic_ns()}"
    url = f"file://{work / tag / 'ckpt'}" if ckpt_every else ""
    spec = work / f"{tag}.toml"
    spec.write_text(SPEC.format(preset=model_preset or preset, data=data, seq_len=seq_len, global_batch=gb, micro_batch=mb,
                                steps=steps, url=url, every=ckpt_every or 20, model_extra=model_extra))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MARIND_LOG_JSON": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run_dir = work / tag / "run"
    if per_rank:
        env.update(MARIND_RUN_DIR=str(run_dir), MARIND_BENCH_PP_TIMING=str(drop))
    else:
        for name in ("MARIND_RUN_DIR", "MARIND_BENCH_PP_TIMING"):
            env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "marind.trainer", str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    events = []
    for line in (proc.stdout + proc.stderr).splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") == "step":
            events.append(ev)
    measured = [e for e in events if e["step"] > drop]
    if not measured:
        raise RuntimeError(f"no step lines from {tag}")
    tokens = seq_len * gb * len(measured)
    wall = sum(e["step_s"] for e in measured)
    router = {}
    if "moe_load_min" in measured[0]:   # a mixture-of-experts run: its step lines carry the router's statistics
        router = {"router": {"load_min": statistics.median(e["moe_load_min"] for e in measured),
                             "load_max": statistics.median(e["moe_load_max"] for e in measured),
                             "dropped": sum(e["moe_dropped"] for e in measured),
                             "balance_loss": statistics.median(e["moe_balance_loss"] for e in measured),
                             "z_loss": statistics.median(e["moe_z_loss"] for e in measured),
                             "tokens_per_expert_last": measured[-1]["moe_tokens_per_expert"]}}
    return {**router, "preset": preset, "ranks": ranks, "steps_measured": len(measured),
            "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_s_median_step": round(statistics.median(e["tokens_per_s"] for e in measured), 1),
            "mfu": round(statistics.median(e["mfu"] for e in measured), 6),
            "memory_bytes_rank0": max(e["memory_bytes"] for e in measured),
            **(rank_figures(run_dir, ranks) if per_rank else {})}


def rank_figures(run_dir: Path, ranks: int) -> dict:
    """Every rank's figures from its final progress record: peak memory (device peak: CUDA allocated on a
    GPU, the RSS high-water mark on CPU), its peak before the first step, and the pipeline's measured
    bubble (``marind.trainer.parallel.pipeline_timing``) when the run had one."""
    from marind.core.progress import read_records
    from marind.trainer.parallel.pipeline_timing import bubble_of_ranks
    records = {r.rank: r for r in read_records(run_dir)}
    missing = [r for r in range(ranks) if r not in records or not (records[r].metrics or {}).get("peak_memory_bytes")]
    if missing:
        raise RuntimeError(f"ranks {missing} left no final record with peak memory under {run_dir}")
    metrics = [records[r].metrics or {} for r in range(ranks)]
    peaks = [int(m["peak_memory_bytes"]) for m in metrics]
    out = {"peak_memory_bytes": peaks, "peak_memory_bytes_max": max(peaks), "peak_memory_bytes_min": min(peaks),
           "setup_peak_memory_bytes": [int(m["setup_peak_memory_bytes"]) for m in metrics]}
    bubble = bubble_of_ranks(metrics)
    if bubble:
        out.update(bubble_measured=bubble["per_rank"], bubble_measured_mean=bubble["mean"])
    return out


def checkpoint_overhead(work: Path, data: str, ranks: int, *, steps: int, repeats: int) -> dict:
    none, every10 = [], []
    for _ in range(repeats):  # interleaved so load drift hits both alike
        none.append(run_job("tiny", ranks, work, data, steps=steps)["tokens_per_s"])
        every10.append(run_job("tiny", ranks, work, data, steps=steps, ckpt_every=10)["tokens_per_s"])
    base, with_ck = statistics.median(none), statistics.median(every10)
    overhead = round(100.0 * (base - with_ck) / base, 2)
    print(f"async checkpoint every 10 steps, {ranks} rank(s): {with_ck:.1f} vs {base:.1f} tokens/s "
          f"({overhead:+.2f} % lost)", flush=True)
    return {"preset": "tiny", "ranks": ranks, "steps": steps, "every_steps": 10, "repeats": repeats,
            "tokens_per_s_none": none, "tokens_per_s_async": every10,
            "baseline_tokens_per_s": base, "marind_tokens_per_s": with_ck, "overhead_pct": overhead}


#: the pipeline rows of ``layouts``: name, schedule, virtual stages per rank (the full run has them all)
PP_LAYOUTS = (("pp", "1F1B", 1), ("pp-gpipe", "GPipe", 1), ("pp-interleaved", "Interleaved1F1B", 2))


def layouts(work: Path, data: str, *, steps: int | None, quick: bool) -> list[dict]:
    """Dense FSDP and pipeline parallel on 2 ranks, the same untied model (``[model]`` extras): 1F1B
    (and, unless quick, GPipe and Interleaved1F1B)."""
    from marind.trainer.parallel.pipeline_timing import schedule_bubble
    _, gb, mb, _, _ = PRESETS["tiny"]
    microbatches = gb // mb   # one schedule run per step: every micro-batch of the rank's batch
    runs = [("fsdp", "dp_shard = 2", 1, "", 1)]
    for name, schedule, v in PP_LAYOUTS[:1] if quick else PP_LAYOUTS:
        runs.append((name, f'dp_shard = 1\npp = 2\npp_schedule = "{schedule}"\npp_microbatches = {microbatches}',
                     2, schedule, v))
    rows = []
    for name, parallel, pp, schedule, v in runs:
        extra = f"n_layers = 4\ntie_embeddings = false\n[parallel]\n{parallel}"
        res = run_job("tiny", 2, work, data, steps=steps, model_extra=extra, per_rank=True)
        res.update(layout=name, pp=pp, schedule=schedule or None, microbatches=microbatches if pp > 1 else None,
                   bubble_fraction=round(schedule_bubble(pp, microbatches, v), 4) if pp > 1 else 0.0)
        rows.append(res)
        print(f"{name:>14} x2: {res['tokens_per_s']:10.1f} tokens/s  bubble {res['bubble_fraction']:.3f} "
              f"(measured {res.get('bubble_measured_mean', 0.0):.3f})  peak/rank {res['peak_memory_bytes']}",
              flush=True)
    return rows


def matched_dense_ffn(*, dim: int, n_experts: int, top_k: int, moe_ffn_dim: int, n_shared_experts: int) -> int:
    """The dense MLP width whose parameters equal one MoE MLP's active ones (router included)."""
    from marind.trainer.model.moe import moe_param_counts
    active = moe_param_counts(dim=dim, n_experts=n_experts, top_k=top_k, moe_ffn_dim=moe_ffn_dim,
                              n_shared_experts=n_shared_experts)[1]
    return round(active / (3 * dim))


def moe_layouts(work: Path, data: str, *, steps: int | None, quick: bool) -> list[dict]:
    """moe-tiny with ep = 2 (and pp = 2 unless quick) beside dense FSDP of the same active parameters."""
    from marind.trainer.model.moe_spec import MOE_PRESETS
    from marind.trainer.parallel.pipeline_timing import schedule_bubble
    m = MOE_PRESETS["moe-tiny"]
    dims = {"dim": m["dim"], "n_experts": m["n_experts"], "top_k": m["top_k"], "moe_ffn_dim": m["moe_ffn_dim"],
            "n_shared_experts": m["n_shared_experts"]}
    ffn = matched_dense_ffn(**dims)
    runs = [("dense-fsdp", "tiny", f"dim = {m['dim']}\nn_layers = {m['n_layers']}\nn_heads = {m['n_heads']}\n"
                                   f"ffn_dim = {ffn}", "dp_shard = 2"),
            ("moe-ep2", "moe-tiny", "", "dp_shard = 2\nep = 2")]
    if not quick:
        runs.append(("moe-pp2", "moe-tiny", "", 'dp_shard = 1\npp = 2\npp_schedule = "1F1B"'))
    rows = []
    for name, preset, model, parallel in runs:
        extra = f"{model}\ntie_embeddings = false\n[parallel]\n{parallel}"
        res = run_job("tiny", 2, work, data, steps=steps, model_extra=extra, model_preset=preset, per_rank=True)
        res.update(layout=name, **_param_counts(preset, model))
        if "pp = 2" in parallel:   # pp_microbatches unset: pp of them per schedule run
            res.update(pp=2, schedule="1F1B", microbatches=2, bubble_fraction=round(schedule_bubble(2, 2), 4))
        rows.append(res)
        print(f"{name:>10} x2: {res['tokens_per_s']:10.1f} tokens/s  active {res['active_params']}  "
              f"peak/rank {res['peak_memory_bytes']}", flush=True)
    return rows


def _param_counts(preset: str, model: str) -> dict:
    """Total and active parameters of a bench model without the embedding and the LM head (its spec
    resolved as the trainer does; the vocabulary does not matter then)."""
    from marind.trainer.config import load_trainer_spec
    from marind.trainer.model.gpt import ModelConfig, param_count
    spec = load_trainer_spec(f'[job]\nname = "p"\n[model]\npreset = "{preset}"\n{model}\ntie_embeddings = true\n'
                             f'[data]\npath = "x"\nglobal_batch = 2\nmicro_batch = 1\n', check_worlds=False)
    cfg = ModelConfig.from_spec(spec.model, seq_len=spec.data.seq_len, data_vocab_size=256)
    return {"total_params": param_count(cfg, embedding=False), "active_params": param_count(cfg, embedding=False,
                                                                                             active=True)}


#: what one run can measure (``--sections``)
SECTIONS = ("throughput", "overhead", "layouts")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced matrix for a shape check")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the checkpoint-overhead pair")
    ap.add_argument("--presets", default="tiny,125m")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--ckpt-ranks", default="1,2", help="rank counts of the checkpoint-overhead pairs")
    ap.add_argument("--layout-steps", type=int, default=0,
                    help="steps of each layouts run (default: 12 with --quick, else the preset's); "
                         "the first 5 are warm-up, not measured")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if args.layout_steps and args.layout_steps <= PRESETS["tiny"][4]:
        ap.error(f"--layout-steps {args.layout_steps}: must be > {PRESETS['tiny'][4]} (the warm-up steps)")
    if not sections <= set(SECTIONS):
        ap.error(f"--sections {args.sections!r}: use some of {', '.join(SECTIONS)}")
    presets = ["tiny"] if args.quick else args.presets.split(",")
    ranks_list = [1] if args.quick else [int(r) for r in args.ranks.split(",")]
    repeats = 1 if args.quick else args.repeats

    from marind.commands.data import prepare
    work = Path(tempfile.mkdtemp(prefix="marind-train-bench-"))
    data = str(work / "example")
    prepare([], data, example=True, example_docs=200 if args.quick else 600)

    throughput = []
    for preset in presets if "throughput" in sections else []:
        for ranks in ranks_list:
            res = run_job(preset, ranks, work, data, steps=12 if args.quick else None)
            throughput.append(res)
            print(f"{preset:>5} x{ranks}: {res['tokens_per_s']:10.1f} tokens/s  mfu {res['mfu']:.4f}", flush=True)

    overheads = []
    for ck_ranks in ([] if "overhead" not in sections else [1] if args.quick
                     else [int(r) for r in args.ckpt_ranks.split(",")]):
        overheads.append(checkpoint_overhead(work, data, ck_ranks, steps=12 if args.quick else 60,
                                             repeats=repeats))
    run_layouts = "layouts" in sections
    layout_steps = args.layout_steps or (12 if args.quick else None)
    layout_rows = layouts(work, data, steps=layout_steps, quick=args.quick) if run_layouts else []
    moe_rows = moe_layouts(work, data, steps=layout_steps, quick=args.quick) if run_layouts else []
    import torch
    out = {
        "bench": "train",
        "quick": bool(args.quick),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "throughput": throughput,
        "checkpoint_overhead": overheads,
        "layouts": layout_rows,
        "moe": moe_rows,
        "sections": sorted(sections),
        "floor": {"overhead_pct_max": 5.0, "ok": all(o["overhead_pct"] <= 5.0 for o in overheads)},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from marind.testing.procs import exit_on_sigterm
    exit_on_sigterm()       # subprocess.run kills its torchrun when SIGTERM ends the wait
    sys.exit(main())

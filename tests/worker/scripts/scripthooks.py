"""Test hooks shared by the user-style scripts here: fault injection, start log, final digests.

Nothing of marind's trainer: the scripts and this module stand for a team's own code. The
hooks are driven by environment variables so that the same script runs under a bare
torchrun and under ``marind agent``:

* ``WORKER_TEST_KILL_AT_STEP=N``: rank 1 SIGKILLs itself once, after step N (a marker file
  in the output dir makes it once per output dir).
* ``WORKER_TEST_HANG_AT_STEP=N``: rank 0 sleeps forever once, after step N.
* ``WORKER_TEST_STEP_SLEEP=S``: every rank sleeps S seconds after each step (time to signal it).

Outputs, under ``--out``: ``starts.jsonl`` (one line per rank start: rank, pid, step
loaded) and ``digest-rank{r}.json`` at the end (sha256 over the rank's model and optimizer
state, by FQN, and the step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict


def parse_args(steps: int = 8, save_every: int = 2) -> argparse.Namespace:
    """``--steps``, ``--save-every`` and ``--out`` (defaults from ``WORKER_TEST_*``); other args ignored."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=int(os.environ.get("WORKER_TEST_STEPS", steps)))
    parser.add_argument("--save-every", type=int, default=int(os.environ.get("WORKER_TEST_SAVE_EVERY", save_every)))
    parser.add_argument("--out", default=os.environ.get("WORKER_TEST_OUT", "."))
    args, _ = parser.parse_known_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def note_start(out: str, rank: int, step: int | None) -> None:
    """Append this rank's start (and the step it loaded) to ``starts.jsonl``."""
    with open(Path(out) / "starts.jsonl", "a") as fh:
        fh.write(json.dumps({"rank": rank, "pid": os.getpid(), "loaded": step}) + "\n")


def _once(out: str, name: str) -> bool:
    marker = Path(out) / name
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def after_step(out: str, rank: int, step: int) -> None:
    """The fault hooks, after ``step`` steps are complete."""
    kill_at = int(os.environ.get("WORKER_TEST_KILL_AT_STEP", "0"))
    if kill_at and step == kill_at and rank == 1 and _once(out, "killed-once"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("WORKER_TEST_STEP_SLEEP", "0")))
    hang_at = int(os.environ.get("WORKER_TEST_HANG_AT_STEP", "0"))
    if hang_at and step == hang_at and rank == 0 and _once(out, "hung-once"):
        while True:
            time.sleep(3600)


def _bytes(t: torch.Tensor) -> bytes:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_digest(out: str, rank: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over this rank's model and optimizer state (by FQN, sorted) and the step; written to a file."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    h = hashlib.sha256(str(step).encode())
    for fqn in sorted(model_sd):
        h.update(fqn.encode())
        h.update(_bytes(model_sd[fqn]))
    state = optim_sd["state"]
    for fqn in sorted(state):
        for name in sorted(state[fqn]):
            h.update(f"{fqn}/{name}".encode())
            value = state[fqn][name]
            h.update(_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    digest = h.hexdigest()
    n_state = sum(len(v) for v in state.values())
    (Path(out) / f"digest-rank{rank}.json").write_text(json.dumps({"step": step, "sha256": digest,
                                                                   "optim_entries": n_state}))
    return digest

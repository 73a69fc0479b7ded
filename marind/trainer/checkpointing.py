"""The trainer's checkpoint state, saved and restored through ckpt_store.

State tree (docs/design.md §4)::

    model/{fqn}                 DTensor parameters (any layout)
    optim/{fqn}/{exp_avg,exp_avg_sq,step}
    extra/step, extra/data_position, extra/scheduler, extra/param_groups, extra/layout
    extra/rng/rank-{N}          this rank's torch RNG state (base64 of the byte tensor)
    extra/model_config          the model's shape (ModelConfig fields; absent in older checkpoints)

``get_state_dict`` / ``set_state_dict`` (torch.distributed.checkpoint.state_dict)
map between modules and FQN-keyed trees, so a checkpoint restores into
any mesh. RNG on resume: a rank with a saved ``rank-N`` entry restores it;
a rank without one (the world grew) re-seeds from ``seed + step`` and its
rank (the model has no dropout, so this affects nothing numeric today).
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ckpt_store import CheckpointSaveFailed, CheckpointStore, PendingSave, all_ranks_ok
from ckpt_store.errors import DISK_FULL, failure_reason
from marind.core import workerenv as WE
from marind.core.lease_file import lease_path, read_lease_doc, save_held
from marind.core.log import get_logger
from marind.trainer.config import TrainerSpec
from marind.trainer.parallel.pipeline_ckpt import StageArrays

log = get_logger(__name__)

def _prepare_bound(seconds: float, run_dir: str | None) -> float | None:
    """How long an async save may wait on the storage in the training thread
    (``checkpoint.prepare_timeout``): only under an agent, where a silent storage (a cut
    control network) would stall the step until the node is taken for lost; 0 = unbounded."""
    return seconds if run_dir and seconds > 0 else None


def checkpoint_url(url: str) -> str:
    """A bare local path becomes an absolute ``file://`` URL."""
    if not url or "://" in url:
        return url
    return "file://" + os.path.abspath(url)


def rng_state() -> dict[str, str]:
    """This process's torch (and CUDA) RNG state, base64 encoded."""
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def restore_rng(saved: dict[str, str] | None, *, seed: int, step: int, rank: int) -> bool:
    """Restore :func:`rng_state`'s ``saved``; without one, seed from ``seed``, ``step`` and ``rank``.

    Returns:
        Whether a saved state was restored.
    """
    if not saved:
        torch.manual_seed(seed + 1_000_003 * step + rank)
        return False
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["torch"])), dtype=torch.uint8))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["cuda"])),
                                                  dtype=torch.uint8))
    return True


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create empty Adam state (a zero-lr step on zero grads) so a checkpoint can be loaded into it."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


class Checkpointer:
    """Save every N steps / T seconds (async), restore the latest committed step.

    Args:
        spec: the run's spec (``[checkpoint]``; no ``url``: checkpoints are off).
        model: the (parallelized) model.
        optimizer: its optimizer.
        rank: global rank.
        world_size: ranks in the world.
        layout: the mesh sizes, recorded in each checkpoint.
        model_config: the model's config (``ModelConfig`` as a dict), saved as ``extra/model_config``
            so that a checkpoint can be exported on its own (``marind ckpt export --format hf``).
        stage_arrays: under pipeline parallelism, completes each rank's tree with the other
            stages' arrays (``marind.trainer.parallel.pipeline_ckpt``); None otherwise.
    """

    def __init__(self, spec: TrainerSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
                 world_size: int, layout: dict[str, int], model_config: dict[str, Any] | None = None,
                 stage_arrays: StageArrays | None = None) -> None:
        self.spec, self.model, self.optimizer = spec, model, optimizer
        self.stage_arrays = stage_arrays
        self.model_config = model_config
        self.rank, self.world_size, self.layout = rank, world_size, layout
        c = spec.checkpoint
        self.store: CheckpointStore | None = None
        self.run_dir = os.environ.get(WE.RUN_DIR)   # under an agent: never commit for a replaced world
        # how long a save due while the previous one still runs waits for it (then it is skipped)
        self.overlap_wait: float | None = _prepare_bound(c.prepare_timeout, self.run_dir)
        if c.url:
            run_dir = self.run_dir
            self.store = CheckpointStore(checkpoint_url(c.url), keep_last=c.keep_last or None,
                                         keep_every=c.keep_every or None,
                                         fence_file=str(lease_path(run_dir)) if run_dir else None,
                                         prepare_timeout_s=self.overlap_wait)
            if hasattr(optimizer, "register_step_pre_hook"):
                self.store.protect(optimizer)   # async snapshots overlap the next forward/backward
        self.pending: PendingSave | None = None
        self.started_step: int | None = None   # last save started (maybe still in flight)
        self.last_step: int | None = None      # last save known committed (or restored)
        self.failures = 0
        self.last_error: str | None = None     # why the latest save failed (cleared by a commit): status shows it
        #: told ``last_error`` as it changes (the progress record's ``checkpoint_error``: status, events)
        self.on_error: Callable[[str | None], None] | None = None
        self._failed_step: int | None = None   # the failed save last logged (each is logged once)
        self._busy_step: int | None = None     # a save in flight that a due save already waited for, then skipped
        self.last_saved_at = time.monotonic()
        # (step, held on some rank, this rank's reason): the loop's agreement (``held_here``/``agree_held``)
        self._held: tuple[int, bool, str | None] | None = None
        self._held_reason: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are on (``checkpoint.url`` set)."""
        return self.store is not None

    @property
    def url(self) -> str | None:
        """The store's URL, None when checkpoints are off."""
        return self.store.url if self.store is not None else None

    def _options(self) -> StateDictOptions:
        return StateDictOptions(full_state_dict=False, cpu_offload=False)

    def build_state(self, step: int, data_position: int) -> dict[str, Any]:
        """The state tree of a checkpoint of ``step`` (see the module docstring)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        param_groups = cast(list[dict[str, Any]], optim_sd.get("param_groups", []))
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                  for g in param_groups]
        tree = {
            "model": model_sd,
            "optim": optim_sd.get("state", {}),
            "extra": {
                "step": step,
                "data_position": data_position,
                "scheduler": {"kind": "warmup_cosine", "step": step},
                "param_groups": groups,
                "layout": self.layout,
                "world_size": self.world_size,
                "rng": {f"rank-{self.rank}": rng_state()},
                **({"model_config": self.model_config} if self.model_config else {}),
            },
        }
        return self.stage_arrays.complete(tree) if self.stage_arrays is not None else tree

    def due(self, step: int) -> bool:
        """Whether ``step`` is a multiple of ``checkpoint.every_steps`` (and checkpoints are on)."""
        c = self.spec.checkpoint
        return self.enabled and c.every_steps > 0 and step % c.every_steps == 0

    def time_due(self) -> bool:
        """Whether ``checkpoint.every_seconds`` have passed since the last save started."""
        c = self.spec.checkpoint
        return (self.enabled and c.every_seconds is not None
                and time.monotonic() - self.last_saved_at >= c.every_seconds)

    def poll(self) -> int | None:
        """Note a finished background save (a failure is logged, not fatal); returns the committed step."""
        if self.pending is not None and self.pending.done():
            self._settle(0)
        return self.last_step

    def _settle(self, timeout: float) -> None:
        """This rank's view of the save in flight once it is done (no collective)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait(timeout)
        except CheckpointSaveFailed as exc:
            self._failed(pending.step, str(exc.__cause__ or exc))
            return
        except TimeoutError:
            self.pending = pending
            raise
        self.last_step = pending.step
        self._set_error(None)

    def _set_error(self, reason: str | None) -> None:
        if reason != self.last_error and self.on_error is not None:
            self.on_error(reason)
        self.last_error = reason

    def _failed(self, step: int, error: str) -> str:
        """Log a failed save of ``step`` once (``checkpoint_failed`` with its kind and reason); returns its kind."""
        kind, reason = failure_reason(step, error, self.url)
        if self._failed_step != step:
            self._failed_step = step
            self.failures += 1
            log.error("checkpoint_failed", step=step, kind=kind, error=reason, failures=self.failures,
                      last_committed=self.last_step)
        self._set_error(reason)
        return kind

    def _agree_previous(self, step: int, wait: bool) -> bool:
        """Every rank: the save in flight is over everywhere, its outcome the same on every rank
        (``CheckpointStore.settle``: a rank still waiting for a commit that will not come stops,
        so no rank is left in a collective alone). A save due while it still runs waits at most
        ``overlap_wait`` (under an agent: ``checkpoint.prepare_timeout``) unless ``wait``; then it
        is skipped on every rank (``checkpoint_skipped``) and training goes on; the saves due after it
        while that same save still runs skip without waiting. Returns False then."""
        assert self.store is not None
        give_up = None if wait or self.overlap_wait is None else (
            0.0 if self._busy_step == self.store.pending_step else self.overlap_wait)   # waited once: enough
        outcome = self.store.settle(self.spec.checkpoint.wait_timeout, give_up)
        if outcome == "busy":
            self._busy_step = self.store.pending_step      # the same on every rank
            self.failures += 1
            log.error("checkpoint_skipped", step=step, failures=self.failures,
                      reason=f"the save of step {self.store.pending_step} is still in flight on some rank "
                             f"after {self.overlap_wait:g}s (a slow storage): training goes on")
            return False
        self._observe(outcome)
        return True

    def _observe(self, outcome: str | None) -> None:
        """The agreed outcome of the last save started (``CheckpointStore.settle``), on this rank."""
        if self.pending is not None:
            self._settle(0)
        step = self.store.pending_step if self.store is not None else None
        if outcome is not None and step is not None:   # failed, maybe on another rank only
            self._failed(step, outcome)

    def save(self, step: int, data_position: int, *, wait: bool = False) -> None:
        """Start a save of ``step`` (async unless ``wait`` or ``[checkpoint] async = false``); no-op when off.

        Args:
            step: the step the checkpoint holds (a second call for the same step only waits, if asked).
            data_position: the data position saved with it.
            wait: block until it committed.

        Raises:
            CheckpointSaveFailed: with ``wait``, the save did not commit.
            TimeoutError: the previous save, or this one with ``wait``, outlasted ``checkpoint.wait_timeout``.
        """
        if self.store is None:
            return
        if self.started_step != step:
            if not wait and self._skip_while_cut_off(step):
                return
            if not self._agree_previous(step, wait):
                return
            state = self.build_state(step, data_position)
            async_ = self.spec.checkpoint.async_ and not wait
            try:
                self.pending = self.store.save(step, state, async_=async_)
            except CheckpointSaveFailed as exc:      # on every rank alike
                kind = self._failed(step, str(exc))
                if not async_ and kind != DISK_FULL:
                    raise
                return      # async: training goes on; a final save on a full disk: a restart would not help
            self.started_step = step
            self.last_saved_at = time.monotonic()
            log.debug("checkpoint_started", step=step, async_=async_,
                      blocked_s=round(self.pending.timings.get("blocked_s", 0.0), 4))
        if wait:
            self.wait()
            if self.last_step != step:
                raise CheckpointSaveFailed(f"checkpoint step {step} did not commit (see checkpoint_failed)")

    def held_here(self, step: int) -> bool:
        """Whether this rank's lease file holds commits now (``lease_file.save_held``: the node's
        lease unrenewed for more than half its TTL, or commits fenced while no data-network peer
        answers); False without an agent or checkpoints, or when no save can be due at ``step``
        (not a multiple of ``every_steps`` and no ``every_seconds``: the same on every rank).
        The training loop all-reduces it with its per-step flags and hands the result to
        ``agree_held``, so that a save's skip costs no collective of its own."""
        self._held_reason = None
        if self.run_dir is None or self.store is None or not (
                self.due(step) or self.spec.checkpoint.every_seconds is not None):
            return False
        self._held_reason = self._lease_hold()
        return self._held_reason is not None

    def _lease_hold(self) -> str | None:
        """Why this rank's lease file holds commits now (``lease_file.save_held``); None: it does not."""
        assert self.run_dir is not None
        return save_held(read_lease_doc(self.run_dir), time.time())

    def agree_held(self, step: int, anywhere: bool) -> None:
        """Whether ``held_here(step)`` was True on any rank (the loop's all-reduce); a ``save`` of
        ``step`` then skips on every rank when it was."""
        self._held = (step, anywhere, self._held_reason)

    def _skip_while_cut_off(self, step: int) -> bool:
        """Under an agent: skip this save, on every rank, when on some rank the lease file holds
        commits (``held_here``): its storage calls could stall the step (waiting on the previous
        save too, itself held in the commit fence), and its commit would wait for the fence
        anyway. The ranks agree through the loop's per-step all-reduce (``agree_held`` for this
        step) or, for a save outside it, one all-reduce here."""
        if self.run_dir is None:
            return False
        agreed, self._held = self._held, None
        if agreed is not None and agreed[0] == step:
            _, held, reason = agreed
        else:   # a save outside the loop's agreement (every rank takes this same branch)
            reason = self._lease_hold()
            held = not all_ranks_ok(reason is None)
        if not held:
            return False
        self.failures += 1
        log.error("checkpoint_skipped", step=step, failures=self.failures,
                  reason=reason or "held on another rank of this world")
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the save in flight; failures are logged. Every rank calls it: the
        ranks agree on the save's outcome (``CheckpointStore.settle``).

        Args:
            timeout: seconds; ``checkpoint.wait_timeout`` when None.

        Raises:
            TimeoutError: the save is still running after ``timeout`` (it stays pending).
        """
        if self.store is not None:
            self._observe(self.store.settle(timeout if timeout is not None else self.spec.checkpoint.wait_timeout))

    def latest(self) -> int | None:
        """The latest committed step in the store; None when there is none or checkpoints are off."""
        return self.store.latest() if self.store is not None else None

    def restore(self) -> tuple[int, int] | None:
        """Load the latest committed step into model, optimizer and this rank's RNG.

        Returns:
            (step, data_position), or None when checkpoints are off or there is none.

        Raises:
            ckpt_store.CheckpointError: the checkpoint cannot be read or does not fit the model.
        """
        if self.store is None or self.store.latest() is None:
            return None
        init_optimizer_state(self.optimizer)
        state = self.build_state(0, 0)
        state["extra"] = {"step": 0, "data_position": 0, "rng": {}}
        self.store.load(state)
        if self.stage_arrays is not None:
            self.stage_arrays.own(state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": self._groups()},
                       options=self._options())
        extra = state["extra"]
        step, position = int(extra["step"]), int(extra["data_position"])
        restore_rng((extra.get("rng") or {}).get(f"rank-{self.rank}"), seed=self.spec.train.seed,
                    step=step, rank=self.rank)
        self.last_step = self.started_step = step
        self.last_saved_at = time.monotonic()
        return step, position

    def _groups(self) -> list[dict[str, Any]]:
        _, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        return cast(list[dict[str, Any]], optim_sd["param_groups"])

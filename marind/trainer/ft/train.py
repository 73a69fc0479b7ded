"""torchft mode (``[fault] mode = "torchft"``): this torch world is ONE replica group.

FSDP2/TP work inside the group as in ``marind.trainer.train``; across groups the
gradients are averaged through a torchft ``Manager`` and its reconfigurable
process group (gloo on CPU, NCCL on CUDA), so when a group dies the others keep stepping (their
quorum shrinks), and a restarted group joins the next quorum and receives
the live parameters and optimizer state from a healthy peer (torchft's HTTP
checkpoint transport), not from the durable store.

The loop is ``marind.trainer.loop.run_loop``, the one the elastic mode runs too; what is
torchft's sits in :class:`TorchftMode`'s hooks, and the Manager, its quorum and the
lighthouse in ``marind.trainer.ft.group``.

Per step: quorum (synchronous, so a healing group has its state before the
forward) -> forward/backward on this group's slice of the data -> one
flat all-reduce of the local gradient shards across groups -> clip ->
``should_commit`` -> optimizer step. The step count is the Manager's, the
data position and learning rate are pure functions of it, so a healed
group needs nothing else.

What the worker reads (set by ``marind agent``, or by hand):
``MARIND_REPLICA_GROUP`` (this group's slot, 0..replica_groups-1),
``TORCHFT_LIGHTHOUSE`` (``http://host:port``) or, preferred because the
agent rewrites it when the lighthouse moves, ``$MARIND_RUN_DIR/ft/lighthouse.json``
(``marind.core.lighthouse_file``). On a quorum failure the Manager is rebuilt
with the current lighthouse; ``epoch`` prefixes the process-group store
keys so that a new lighthouse's restarted quorum ids never meet stale keys.

Durable checkpoints (ckpt_store) are written by the group that is replica
rank 0 of the step's quorum only. A group whose first quorum finds no live
peer ahead of step 0 restores the latest durable checkpoint.

A group may span several nodes (``fault.nodes_per_group``): its torch world
is their one torchrun rendezvous, and nothing here depends on where ranks run.

Not (yet) here: the non-finite-step rollback and ``nan_at_step`` of
``marind.trainer.train`` (a non-finite step is reported to the Manager and not
committed, by every group alike); overlapping the quorum with the forward
pass (torchft's async quorum). If the lighthouse moves while the ranks of
one group disagree about it, that group fails and torchrun restarts it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_store import all_ranks_ok
from marind.core.workerenv import REPLICA_GROUP, TEST_FT_PAUSE_FILE, WorkerEnv
from marind.trainer.build import Run, setup_run
from marind.trainer.checkpointing import init_optimizer_state
from marind.trainer.config import TrainerSpec
from marind.trainer.data.dataset import rank_sample_indices
from marind.trainer.ft.drift import DriftCheck
from marind.trainer.ft.group import (
    MAX_QUORUM_FAILURES,
    FTGroup,
    LighthouseSource,
    LiveState,
    StopRequested,
    allreduce_grads,
)
from marind.trainer.hf.init_from import init_run_from
from marind.trainer.loop import Finish, LoopState, Result, StepReport, StopFlag, TrainMode, log_due, run_loop

#: a group that did not save the last step looks for its checkpoint this often before it ends
FINAL_POLL_S = 0.2


def sample_indices(step: int, *, micro_step: int, spec: TrainerSpec, group: int, groups: int,
                   dp_rank: int, dp_size: int) -> range:
    """Global sample indices of one micro-batch: every group slot owns a fixed slice of each step.

    Step ``s`` covers samples ``[s*B*G, (s+1)*B*G)`` (B = data.global_batch per group,
    G = fault.replica_groups); a missing group's slice is skipped, never reassigned.
    """
    d = spec.data
    return rank_sample_indices(step * d.global_batch * groups, micro_step=micro_step,
                               micro_batch=d.micro_batch, dp_rank=group * dp_size + dp_rank,
                               dp_size=groups * dp_size)


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over this rank's local parameter shards (equal across groups iff same state)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TorchftMode(TrainMode):
    """The torchft loop's hooks: the Manager's step, quorum per step, cross-group gradients.

    Args:
        group: this group's slot, 0..fault.replica_groups-1.
        stop: the worker's stop flag (quorum waits give up when it is set).
        lighthouse: where the lighthouse address comes from.
    """

    grads_to_none = False       # the cross-group all-reduce wants every gradient tensor, zeros included
    announce_saves = True       # "durable_checkpoint": which group wrote which step

    def __init__(self, group: int, stop: StopFlag, lighthouse: LighthouseSource) -> None:
        self.group, self.stop, self.lighthouse = group, stop, lighthouse
        self._ft: FTGroup | None = None
        self.first = True           # the first quorum decides: restore, heal from a peer, or start
        self.quorum_id: int | None = None   # the last quorum seen (a new one alone may be behind a checkpoint)
        self.failures = 0           # quorum failures in a row
        self.parent = 0             # torchrun's pid
        self.pause_file = os.environ.get(TEST_FT_PAUSE_FILE) or None   # test hook
        self.drift: DriftCheck | None = None     # fault.drift_check_every (after start)
        self.attempted = 0                        # the step being attempted (for the drift check)

    @property
    def ft(self) -> FTGroup:
        """This group's Manager holder (after ``start``)."""
        if self._ft is None:
            raise RuntimeError("TorchftMode.start has not run")
        return self._ft

    def log_context(self) -> dict[str, Any]:
        """The replica group, on every log line."""
        return {"replica_group": self.group}

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Adam state exists before a peer's state is copied into it."""
        init_optimizer_state(optimizer)

    def start(self, run: Run, state: LoopState) -> None:
        """Note the group in the progress record, build the Manager (collective), log train_start."""
        spec, f = run.spec, run.spec.fault
        run.progress.update(replica_group=self.group)
        self.drift = DriftCheck(f.drift_check_every, self.group, run.rank)
        self._ft = FTGroup(spec, LiveState(run.model, run.optimizer), run.rank, run.world, self.group,
                           run.env.job_id or spec.job.name, self.stop, self.lighthouse)
        if run.rank == 0:
            run.log.info("train_start", mode="torchft", replica_group=self.group, replica_groups=f.replica_groups,
                         world_size=run.world, layout=run.layout.as_dict(), grad_accum=run.accum,
                         steps=spec.train.steps, lighthouse_epoch=self.ft.epoch)
        run.progress.update(phase="training")
        self.parent = os.getppid()

    def _position(self, run: Run, step: int) -> int:
        return step * run.spec.data.global_batch * run.spec.fault.replica_groups

    def _set_step(self, run: Run, state: LoopState, step: int) -> None:
        state.step, state.position = step, self._position(run, step)

    def _quorum(self, run: Run) -> bool:
        """One quorum attempt; False after a failure (the Manager is rebuilt), True when it formed."""
        try:
            previous, since = self.ft.manager.num_participants(), self.ft.quorum_at
            self.ft.start_quorum()          # synchronous: a healing group holds the peer's state now
            self.ft.check_alone(previous if since is not None else None, since, run.log)
            return True
        except StopRequested:
            raise
        except Exception as exc:
            self.failures += 1
            if self.failures > MAX_QUORUM_FAILURES:
                raise
            run.log.warning("ft_quorum_failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                            failures=self.failures)
            self.ft.rebuild(run.log, "quorum failed")
            return False

    def next_step(self, run: Run, state: LoopState) -> bool:
        """Quorum (retried, the Manager rebuilt, until one forms); on the first: restore or heal."""
        try:
            while True:
                if os.getppid() != self.parent:   # torchrun is gone: a lone worker would keep a group slot alive
                    raise RuntimeError(f"parent process {self.parent} (torchrun) is gone; stopping this worker")
                state.t_mark = time.perf_counter()     # step_s: this attempt only (a failed one is not a step)
                if self._quorum(run):
                    break
        except StopRequested:
            state.stopped = True
            return False
        manager, ckpt = self.ft.manager, run.ckpt
        step = manager.current_step()
        quorum_id, self.quorum_id = self.quorum_id, self.ft.status()["quorum_id"]
        if not self.first and quorum_id != self.quorum_id and ckpt.enabled and manager.num_participants() == 1:
            # a new quorum of this group alone: the groups ahead of it are gone (the job may even have
            # finished during a cut), and a durable checkpoint past its own step is their work, not lost
            latest = ckpt.latest()
            if latest is not None and latest > step:
                step = self._restore(run, reason=f"alone in a new quorum at step {step}, behind checkpoint {latest}")
                run.progress.update(phase="training", step=step, last_checkpoint_step=ckpt.last_step)
        if self.first:
            self.first = False
            if step == 0 and ckpt.enabled and ckpt.latest() is not None:
                step = self._restore(run, reason="no group ahead of this one")
            elif step == 0:
                init_run_from(run)   # [model] init_from: a fresh run (no checkpoint, no peer ahead)
            elif run.rank == 0:
                run.log.info("healed_from_peer", step=step)
            run.progress.update(phase="training", step=step, last_checkpoint_step=ckpt.last_step, **self.ft.status())
        if self.drift is not None:
            self.drift.after_quorum(step, manager.num_participants())
        self._set_step(run, state, step)
        return step < run.spec.train.steps

    def _restore(self, run: Run, reason: str) -> int:
        """Load the latest durable checkpoint and set the Manager's step to it; the step."""
        run.progress.update(phase="restoring")
        restored = run.ckpt.restore()
        if restored is None:
            raise RuntimeError("the latest durable checkpoint went away while restoring it")
        self.ft.manager.load_state_dict({"step": restored[0], "batches_committed": 0})
        if run.rank == 0:
            run.log.info("restored", step=restored[0], url=run.ckpt.url, reason=reason)
        return restored[0]

    def sample_indices(self, run: Run, state: LoopState, micro_step: int) -> Sequence[int]:
        """This group's fixed slice of the step's samples (see :func:`sample_indices`)."""
        return sample_indices(state.step, micro_step=micro_step, spec=run.spec, group=self.group,
                              groups=run.spec.fault.replica_groups, dp_rank=run.layout.dp_rank,
                              dp_size=run.layout.dp_size)

    def on_gradients(self, run: Run, state: LoopState) -> None:
        """Average the gradients across the quorum's replica groups (given up if a member goes silent)."""
        if self.pause_file and os.path.exists(self.pause_file):
            run.log.info("test_pause", step=state.step + 1)
            while os.path.exists(self.pause_file):
                time.sleep(0.05)
        self.attempted = state.step + 1
        allreduce_grads(self.ft.manager, run.params, self.ft)

    def commit(self, run: Run, state: LoopState, grad_norm: torch.Tensor) -> bool:
        """The Manager's ``should_commit`` (a non-finite norm is reported to it first: no group commits)."""
        manager = self.ft.manager
        if not bool(torch.isfinite(grad_norm)):
            manager.report_error(FloatingPointError(f"non-finite gradient norm at step {state.step + 1}"))
        committed = manager.should_commit()
        if committed:
            self.failures = 0
        return committed

    def advance(self, run: Run, state: LoopState, committed: bool) -> None:
        """The Manager's step (unchanged when the step was not committed)."""
        self._set_step(run, state, self.ft.manager.current_step())

    def report_step(self, run: Run, state: LoopState, report: StepReport) -> None:
        """Rank 0, committed steps only: the ``step`` line with the quorum's participants."""
        if run.rank != 0 or not report.committed or not log_due(report.step, run.spec):
            return
        run.log.info("step", step=report.step, loss=round(report.loss, 6), grad_norm=round(float(report.grad_norm), 6),
                     lr=report.lr, participants=self.ft.manager.num_participants(), step_s=round(report.step_s, 4),
                     **report.router)

    def after_step(self, run: Run, state: LoopState) -> None:
        """Every ``fault.drift_check_every`` committed steps: compare the groups' state (``ft.drift``);
        a drifted group's step goes back by one, so that the next quorum heals it from a peer."""
        if self.drift is not None and self.drift.after_step(run.model, run.optimizer, self.ft, attempted=self.attempted,
                                                            step=state.step, device=run.device):
            self._set_step(run, state, self.ft.manager.current_step())

    def progress_fields(self) -> dict[str, Any]:
        """The quorum fields of the progress record (and the last drift finding)."""
        return {**self.ft.status(), **(self.drift.progress_fields() if self.drift is not None else {})}

    def save_due(self, run: Run, state: LoopState, committed: bool, time_due: bool) -> bool:
        """Every ``checkpoint.every_steps`` committed steps, by replica rank 0 of the quorum only."""
        return committed and run.ckpt.due(state.step) and self.ft.manager.participating_rank() == 0

    def after_loop(self, run: Run, state: LoopState) -> None:
        """The final step is the Manager's."""
        self._set_step(run, state, self.ft.manager.current_step())

    def final_save_due(self, run: Run, state: LoopState) -> bool:
        """Replica rank 0 of the last quorum saves the last step, unless it is saved already."""
        ckpt = run.ckpt
        return ckpt.enabled and self.ft.manager.participating_rank() == 0 and ckpt.last_step != state.step

    def finish(self, run: Run, state: LoopState) -> Finish:
        """Wait for the save in flight and, at the end of training, for the last step's checkpoint;
        shut the Manager down; the record gets ``param_digest``.

        Raises:
            RuntimeError: the last step's checkpoint was not committed within ``checkpoint.wait_timeout``.
        """
        run.ckpt.wait()
        if not state.stopped and state.step >= run.spec.train.steps:
            self._await_final_checkpoint(run, state.step)
        self.ft.manager.shutdown(wait=False)
        return Finish(log_fields={"rebuilds": self.ft.rebuilds}, record_fields={"param_digest": param_digest(run.model)})

    def _await_final_checkpoint(self, run: Run, step: int) -> None:
        """A group that did not save the last step ends once the group that did has committed it.

        The agent marks a job SUCCEEDED when a first torchrun exits 0, and a job that SUCCEEDED
        must have its last step durable: the other groups finish before the saving one's commit
        ends. Rank 0 looks at the store every ``FINAL_POLL_S`` and the group agrees on what it saw
        (one all-reduce a look: no rank waits in a collective longer than that). Past
        ``checkpoint.wait_timeout`` the group fails instead of ending well: torchrun restarts it,
        and alone behind the latest checkpoint it restores it and trains the rest itself.
        """
        ckpt = run.ckpt
        if not ckpt.enabled or ckpt.last_step == step:
            return
        started = time.monotonic()
        while True:
            seen = False
            if run.rank == 0:
                try:
                    seen = (ckpt.latest() or 0) >= step
                except Exception as exc:  # noqa: BLE001 - a storage error is a look that saw nothing
                    run.log.warning("final_checkpoint_look_failed", step=step, error=str(exc)[:200])
            if not all_ranks_ok(not seen):      # rank 0 saw it: every rank ends
                return
            if time.monotonic() - started > run.spec.checkpoint.wait_timeout:
                raise RuntimeError(f"the checkpoint of the last step {step} was not committed within "
                                   f"checkpoint.wait_timeout ({run.spec.checkpoint.wait_timeout:g}s) by the group "
                                   "that saves it; failing this group so that it is restarted")
            time.sleep(FINAL_POLL_S)


def train_ft(spec: TrainerSpec, device: torch.device, *, stop: StopFlag | None = None,
             env: WorkerEnv | None = None) -> tuple[Result, torch.nn.Module, torch.optim.Optimizer]:
    """Train in torchft mode: this torch world is one replica group (collective within the group).

    Args:
        spec: the run's spec, with ``[fault] mode = "torchft"``.
        device: this rank's device (``marind.distributed.init_distributed``).
        stop: the stop flag (installed by ``marind.trainer.main``); a fresh one when None.
        env: the worker environment (``MARIND_REPLICA_GROUP``, ``MARIND_RUN_DIR``, ...); read from
            ``os.environ`` when None.

    Returns:
        (result, model, optimizer), as ``marind.trainer.train.train``.

    Raises:
        ValueError: ``MARIND_REPLICA_GROUP`` is outside 0..fault.replica_groups-1.
        RuntimeError: no lighthouse is known, torchrun went away, or quorums kept failing.
    """
    stop = stop or StopFlag()
    env = env if env is not None else WorkerEnv.from_environ()
    f = spec.fault
    group = env.replica_group or 0
    if not 0 <= group < f.replica_groups:
        raise ValueError(f"{REPLICA_GROUP} = {group} is outside 0..fault.replica_groups-1 = {f.replica_groups - 1}")
    mode = TorchftMode(group, stop, LighthouseSource.from_environ(env))
    run = setup_run(spec, device, env, mode)
    result = run_loop(run, mode, stop)
    return result, run.model, run.optimizer

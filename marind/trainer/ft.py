"""torchft mode (``[fault] mode = "torchft"``): this torch world is ONE replica group.

FSDP2/TP work inside the group as in ``marind.trainer.train``; across groups the
gradients are averaged through a torchft ``Manager`` and its reconfigurable
process group (gloo on CPU, NCCL on CUDA), so when a group dies the others keep stepping (their
quorum shrinks), and a restarted group joins the next quorum and receives
the live parameters and optimizer state from a healthy peer (torchft's HTTP
checkpoint transport), not from the durable store.

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
(``{"address", "epoch"}``). On a quorum failure the Manager is rebuilt
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
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from marind.core import workerenv
from marind.core.lighthouse_file import read_lighthouse
from marind.core.log import get_logger
from marind.core.progress import ProgressWriter
from marind.core.spec import RunSpec, grad_accum_steps
from marind.core.workerenv import WorkerEnv
from marind.trainer.checkpointing import Checkpointer, init_optimizer_state
from marind.trainer.data import rank_sample_indices
from marind.trainer.model import lm_loss
from marind.trainer.parallel import clip_grad_norm
from marind.trainer.schedule import lr_at
from marind.trainer.train import Result, StopFlag, build

MOVED_GRACE_S = 2.0          # a quorum waiting this long is abandoned if the lighthouse moved
LIGHTHOUSE_WAIT_S = 30.0     # after a failed quorum: wait this long for a new lighthouse address
BUILD_RETRY_S = 120.0        # rank 0 retries a Manager whose lighthouse is unreachable (< the group PG timeout)
MAX_QUORUM_FAILURES = 20     # in a row, then the worker fails (torchrun restarts the group)


class LighthouseMoved(RuntimeError):
    pass


class StopRequested(Exception):
    """SIGTERM/SIGINT while waiting on a quorum or a lighthouse: stop now (torchrun is restarting us)."""


@dataclass(frozen=True)
class LighthouseSource:
    """Where this worker learns the lighthouse: the agent's file, else ``TORCHFT_LIGHTHOUSE``.

    Args:
        run_dir: ``$MARIND_RUN_DIR`` (its ``ft/lighthouse.json``), None when unset.
        env_address: ``$TORCHFT_LIGHTHOUSE``, None when unset.
    """

    run_dir: Path | None
    env_address: str | None

    @classmethod
    def from_environ(cls) -> LighthouseSource:
        return cls(WorkerEnv.from_environ().run_dir, os.environ.get(workerenv.TORCHFT_LIGHTHOUSE) or None)

    def read(self) -> tuple[str, int]:
        """(address, epoch): the agent's file if readable, else ``TORCHFT_LIGHTHOUSE`` (epoch 0).

        Raises:
            RuntimeError: neither is there.
        """
        rec = read_lighthouse(self.run_dir) if self.run_dir is not None else None
        if rec is not None:
            return rec.address, rec.epoch
        if not self.env_address:
            raise RuntimeError("fault.mode = \"torchft\" needs a lighthouse: run under `marind agent`, "
                               "or set TORCHFT_LIGHTHOUSE=http://HOST:PORT (torchft_lighthouse --min_replicas N)")
        return self.env_address, 0

    def epoch(self) -> int:
        """The current epoch, -1 when no lighthouse is known."""
        try:
            return self.read()[1]
        except RuntimeError:
            return -1


def sample_indices(step: int, *, micro_step: int, spec: RunSpec, group: int, groups: int,
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LiveState:
    """What a healthy group sends to a recovering one: local shards of params and Adam state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.named = list(model.named_parameters())
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return {"model": {n: _local(p.data) for n, p in self.named},
                "optim": {n: {k: _local(v) for k, v in self.optimizer.state[p].items()}
                          for n, p in self.named}}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        for n, p in self.named:
            _local(p.data).copy_(sd["model"][n])
            for k, v in self.optimizer.state[p].items():
                _local(v).copy_(sd["optim"][n][k])


class FTGroup:
    """The torchft Manager of this replica group, rebuilt (collectively) when its quorum fails."""

    def __init__(self, spec: RunSpec, live: LiveState, rank: int, world: int, group: int,
                 stop: StopFlag | None = None, lighthouse: LighthouseSource | None = None):
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        # gloo on CPU; NCCL when the model is on CUDA (not exercised by the CPU test suite)
        base = ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo

        class _EpochPG(base):
            """Store keys under the lighthouse epoch: a new lighthouse restarts quorum ids."""
            epoch = 0

            def configure(self, store_addr: str, *args, **kwargs) -> None:
                super().configure(f"{store_addr}/lh{self.epoch}", *args, **kwargs)

        self.spec, self.live, self.rank, self.world, self.group = spec, live, rank, world, group
        self.stop = stop or StopFlag()
        self.lighthouse = lighthouse or LighthouseSource.from_environ()
        self.timeout = timedelta(seconds=spec.fault.timeout)
        self.pg = _EpochPG(timeout=self.timeout)
        self.manager = None
        self.epoch = -1
        self.rebuilds = 0
        self.build()

    def build(self, state: dict | None = None) -> None:
        """Make this rank's Manager (collective within the group).

        Rank 0 runs the group's ManagerServer, which must reach the lighthouse: it retries (re-reading
        the address) for ``BUILD_RETRY_S`` while a new lighthouse is elected, then publishes the
        manager address in the group's store and broadcasts the lighthouse (address, epoch), so every
        rank of the group configures its process groups under the same epoch. The others make theirs
        after the broadcast: the store outlives a torchrun restart, so an earlier read could be stale.
        """
        from torchft import Manager

        f = self.spec.fault
        job = os.environ.get("MARIND_JOB_ID", self.spec.job.name)

        def make(address: str):
            m = Manager(pg=self.pg, load_state_dict=self.live.load_state_dict, state_dict=self.live.state_dict,
                        min_replica_size=f.min_replicas, use_async_quorum=False, init_sync=False,
                        timeout=self.timeout, quorum_timeout=timedelta(seconds=f.quorum_timeout),
                        connect_timeout=self.timeout, rank=self.rank, world_size=self.world,
                        lighthouse_addr=address, replica_id=f"{job}_rg{self.group}")
            if state:
                m.load_state_dict(state)
            return m

        if self.rank == 0:
            deadline = time.monotonic() + BUILD_RETRY_S
            while True:
                address, epoch = self.lighthouse.read()
                try:
                    self.manager = make(address)
                    break
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise
                    get_logger("trainer").warning("ft_lighthouse_unreachable", address=address,
                                                  error=str(exc).splitlines()[0][:200])
                    self._sleep(1.0)
            box = [address, epoch]
            dist.broadcast_object_list(box, src=0)
        else:
            box = [None, None]
            dist.broadcast_object_list(box, src=0)
            self.manager = make(box[0])
        self.epoch = int(box[1])
        self.pg.epoch = self.epoch

    def rebuild(self, log, why: str) -> None:
        old = self.manager
        state = old.state_dict() if old is not None else None
        if old is not None:
            try:
                old.shutdown(wait=False)
            except Exception as exc:  # noqa: BLE001 - the old manager may be half dead
                log.warning("ft_manager_shutdown_failed", error=str(exc))
        deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
        while time.monotonic() < deadline and self.lighthouse.epoch() == self.epoch:
            self._sleep(0.2)
        self.rebuilds += 1
        self.build(state)
        log.warning("ft_manager_rebuilt", reason=why, epoch=self.epoch, rebuilds=self.rebuilds,
                    step=self.manager.current_step())

    def start_quorum(self) -> None:
        """``manager.start_quorum()``, abandoned when the lighthouse moves while it waits.

        A dead lighthouse is not reported to the waiting client: it would wait out
        ``fault.quorum_timeout``. The call runs in a helper thread instead, and a new
        lighthouse epoch (seen after ``MOVED_GRACE_S``, so that a quorum that was about to
        complete on the old one is not cut short) raises ``LighthouseMoved``.
        """
        manager, box, done = self.manager, {}, threading.Event()

        def run():
            try:
                manager.start_quorum()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="ft-quorum", daemon=True).start()
        started = time.monotonic()
        while not done.wait(0.2):
            if self.stop.requested:
                raise StopRequested()
            if time.monotonic() - started > MOVED_GRACE_S and self.lighthouse.epoch() not in (self.epoch, -1):
                raise LighthouseMoved(f"lighthouse epoch {self.epoch} -> {self.lighthouse.epoch()} during a quorum")
        if "error" in box:
            raise box["error"]

    def _sleep(self, seconds: float) -> None:
        if self.stop.requested:
            raise StopRequested()
        time.sleep(seconds)

    def status(self) -> dict:
        m = self.manager
        return {"replica_group": self.group, "participants": m.num_participants(),
                "replica_rank": m.participating_rank(), "quorum_id": m._quorum_id,
                "lighthouse_epoch": self.epoch, "manager_rebuilds": self.rebuilds}


def _allreduce_grads(manager, params: list) -> None:
    """Average the local gradient shards across replica groups in one flat all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def train_ft(spec: RunSpec, device: torch.device, *, stop: StopFlag | None = None):
    """The torchft loop; returns (Result, model, optimizer) like ``marind.trainer.train.train``."""
    stop = stop or StopFlag()
    f, d, o, t = spec.fault, spec.data, spec.optim, spec.train
    group = int(os.environ.get("MARIND_REPLICA_GROUP", "0"))
    if not 0 <= group < f.replica_groups:
        raise ValueError(f"MARIND_REPLICA_GROUP = {group} is outside 0..fault.replica_groups-1 = {f.replica_groups - 1}")
    model, optimizer, cfg, layout, sampler, rank, world = build(spec, device)
    init_optimizer_state(optimizer)     # Adam state exists before a peer's state is copied into it
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    structlog.contextvars.bind_contextvars(rank=rank, replica_group=group,
                                           **({"job": os.environ["MARIND_JOB_ID"]}
                                              if os.environ.get("MARIND_JOB_ID") else {}))
    log = get_logger("trainer")
    progress = ProgressWriter(rank, local_rank, world, WorkerEnv.from_environ().run_dir)
    progress.update(replica_group=group)
    ckpt = Checkpointer(spec, model, optimizer, rank=rank, world_size=world, layout=layout.as_dict())
    accum = grad_accum_steps(spec, layout.dp_size)
    params = [p for p in model.parameters()]
    ft = FTGroup(spec, LiveState(model, optimizer), rank, world, group, stop)
    if rank == 0:
        log.info("train_start", mode="torchft", replica_group=group, replica_groups=f.replica_groups,
                 world_size=world, layout=layout.as_dict(), grad_accum=accum, steps=t.steps,
                 lighthouse_epoch=ft.epoch)

    losses, skipped, loss_val, stopped, first, failures = [], [], None, False, True, 0
    stop_at = int(os.environ.get("MARIND_TEST_STOP_AT_STEP", "0") or 0)
    progress.update(phase="training")
    parent = os.getppid()
    while True:
        if os.getppid() != parent:          # torchrun is gone: a lone worker would keep a group slot alive
            raise RuntimeError(f"parent process {parent} (torchrun) is gone; stopping this worker")
        t_attempt = time.perf_counter()     # step_s: this attempt only (a failed one is not a step)
        manager = ft.manager
        try:
            try:
                ft.start_quorum()           # synchronous: a healing group holds the peer's state now
            except StopRequested:
                raise
            except Exception as exc:
                failures += 1
                if failures > MAX_QUORUM_FAILURES:
                    raise
                log.warning("ft_quorum_failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                            failures=failures)
                ft.rebuild(log, "quorum failed")
                continue
        except StopRequested:
            stopped = True
            break
        step = manager.current_step()
        if first:
            first = False
            if step == 0 and ckpt.enabled and ckpt.latest() is not None:
                progress.update(phase="restoring")
                restored, _ = ckpt.restore()
                manager.load_state_dict({"step": restored, "batches_committed": 0})
                step = restored
                if rank == 0:
                    log.info("restored", step=step, url=ckpt.store.url)
            elif step > 0 and rank == 0:
                log.info("healed_from_peer", step=step)
            progress.update(phase="training", step=step, last_checkpoint_step=ckpt.last_step, **ft.status())
        if step >= t.steps:
            break
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=t.steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=False)
        loss_acc = torch.zeros((), device=device)
        for k in range(accum):
            x, y = sampler.batch(sample_indices(step, micro_step=k, spec=spec, group=group, groups=f.replica_groups,
                                                dp_rank=layout.dp_rank, dp_size=layout.dp_size), device)
            loss = lm_loss(model(x), y) / accum
            loss.backward()
            loss_acc += loss.detach()
        _allreduce_grads(manager, params)
        norm = clip_grad_norm(params, o.grad_clip)
        if not bool(torch.isfinite(norm)):
            manager.report_error(FloatingPointError(f"non-finite gradient norm at step {step + 1}"))
        committed = manager.should_commit()
        if committed:
            optimizer.step()
            failures = 0
        else:
            skipped.append(step + 1)
        step = manager.current_step()
        flags = torch.stack([loss_acc.float(), torch.tensor(float(stop.requested or step == stop_at), device=device)])
        dist.all_reduce(flags)              # inside the group only
        loss_val = float(flags[0]) / world
        dt = time.perf_counter() - t_attempt
        if committed:
            losses.append(loss_val)
        if rank == 0 and committed and (step % t.log_every == 0 or step == t.steps):
            log.info("step", step=step, loss=round(loss_val, 6), grad_norm=round(float(norm), 6), lr=lr,
                     participants=manager.num_participants(), step_s=round(dt, 4))
        progress.update(step=step, loss=loss_val, tokens_per_s=d.global_batch * d.seq_len / dt,
                        last_checkpoint_step=ckpt.poll(), **ft.status())
        if float(flags[1]) > 0:
            stopped = True
            break
        if committed and step < t.steps and ckpt.due(step) and manager.participating_rank() == 0:
            progress.update(phase="checkpointing")
            if rank == 0:
                log.info("durable_checkpoint", step=step)
            ckpt.save(step, step * d.global_batch * f.replica_groups)
            progress.update(phase="training", last_checkpoint_step=ckpt.last_step)

    step = ft.manager.current_step()
    if not stopped and ckpt.enabled and ft.manager.participating_rank() == 0 and ckpt.last_step != step:
        if rank == 0:
            log.info("durable_checkpoint", step=step)
        ckpt.save(step, step * d.global_batch * f.replica_groups, wait=True)
    ckpt.wait()
    ft.manager.shutdown(wait=False)
    if rank == 0:
        log.info("stopping" if stopped else "train_done", step=step, loss=loss_val, rebuilds=ft.rebuilds)
    progress.update(phase="done", step=step, last_checkpoint_step=ckpt.last_step, param_digest=param_digest(model))
    position = step * d.global_batch * f.replica_groups
    return Result(step, position, loss_val, losses, skipped, 0, stopped, ckpt.last_step), model, optimizer

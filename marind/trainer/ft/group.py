"""One replica group's torchft Manager: lighthouse discovery, quorum, rebuild, live state for healing.

Used by ``marind.trainer.ft.train`` (the torchft training mode). The lighthouse address comes from
the agent's ``$MARIND_RUN_DIR/ft/lighthouse.json`` (``marind.core.lighthouse_file``), else from
``TORCHFT_LIGHTHOUSE``. On a quorum failure the Manager is rebuilt with the current lighthouse;
its ``epoch`` prefixes the process-group store keys so that a new lighthouse's restarted
quorum ids never meet stale keys. A quorum is abandoned when the lighthouse moves while it
waits (``LighthouseMoved``) and when the worker is asked to stop (``StopRequested``). A
cross-group all-reduce is given up when a member of the quorum goes silent
(``FTGroup.await_collective``, the decision in ``marind.trainer.ft.abort``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from marind.core import workerenv
from marind.core.lighthouse_file import read_lighthouse
from marind.core.log import get_logger
from marind.core.workerenv import WorkerEnv
from marind.trainer.config import TrainerSpec
from marind.trainer.ft.abort import Abandoned, PeerSilent, SilentPeerWatch, read_status, wait_slice
from marind.trainer.ft.stale_lighthouse import FreezeWatch, decide_alone
from marind.trainer.loop import StopFlag

if TYPE_CHECKING:
    from torchft import Manager

MOVED_GRACE_S = 2.0          # a quorum waiting this long is abandoned if the lighthouse moved
LIGHTHOUSE_WAIT_S = 30.0     # after a failed quorum: wait this long for a new lighthouse address
REBUILD_PAUSE_S = 1.0        # ... or this long when the lighthouse answers (``rebuild_wait``)
REBUILD_POLL_S = 0.2         # that wait's poll of the epoch, and the bound on its status read
BUILD_RETRY_S = 120.0        # rank 0 retries a Manager whose lighthouse is unreachable (< the group PG timeout)
MAX_QUORUM_FAILURES = 20     # in a row, then the worker fails (torchrun restarts the group)


def rebuild_wait(*, built_epoch: int, epoch: int, answers: Callable[[], bool], waited_s: float) -> tuple[bool, str]:
    """After a failed quorum, whether to wait longer before building a new Manager, and why (pure
    but for ``answers``, the lighthouse's status read, asked only once the pause is over).

    A new lighthouse epoch ends the wait (the agent moved it); so does the lighthouse the Manager was
    built on answering after ``REBUILD_PAUSE_S`` (it is alive: the quorum failed for another reason
    and no new one is coming; the pause keeps a run of failures from spinning); so does
    ``LIGHTHOUSE_WAIT_S``. A silent lighthouse of the same epoch is waited for: its host may be
    gone, and the agents elect another.
    """
    if epoch != built_epoch:
        return False, f"lighthouse epoch {built_epoch} -> {epoch}"
    if waited_s >= LIGHTHOUSE_WAIT_S:
        return False, f"no new lighthouse in {LIGHTHOUSE_WAIT_S:g}s: building on epoch {epoch} again"
    if waited_s >= REBUILD_PAUSE_S and answers():
        return False, f"the lighthouse of epoch {epoch} answers: the quorum failed for another reason"
    return True, "waiting for the lighthouse to answer or move"


class LighthouseMoved(RuntimeError):
    """The lighthouse epoch changed while a quorum waited on the old lighthouse."""


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
    def from_environ(cls, env: WorkerEnv | None = None) -> LighthouseSource:
        """The worker's: ``env.run_dir`` (``os.environ``'s when None) and ``$TORCHFT_LIGHTHOUSE``."""
        env = env if env is not None else WorkerEnv.from_environ()
        return cls(env.run_dir, os.environ.get(workerenv.TORCHFT_LIGHTHOUSE) or None)

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LiveState:
    """What a healthy group sends to a recovering one: local shards of params and Adam state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.named = list(model.named_parameters())
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``{"model": {name: shard}, "optim": {name: {state: shard}}}`` of this rank's local shards."""
        return {"model": {n: _local(p.data) for n, p in self.named},
                "optim": {n: {k: _local(v) for k, v in self.optimizer.state[p].items()}
                          for n, p in self.named}}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy a peer's :meth:`state_dict` into the parameters and Adam state, in place."""
        for n, p in self.named:
            _local(p.data).copy_(sd["model"][n])
            for k, v in self.optimizer.state[p].items():
                _local(v).copy_(sd["optim"][n][k])


class FTGroup:
    """The torchft Manager of this replica group, rebuilt (collectively) when its quorum fails.

    Args:
        spec: the run's spec (``[fault]``: timeouts, ``min_replicas``).
        live: what a healthy group sends to a healing one.
        rank: rank within this group's torch world.
        world: size of that world.
        group: this group's slot, 0..replica_groups-1.
        job: the job's name (``{job}_rg{group}`` is the Manager's replica id).
        stop: the worker's stop flag (waits give up with ``StopRequested`` once it is set).
        lighthouse: where the lighthouse address comes from; the environment's when None.

    Raises:
        Exception: rank 0 found no reachable lighthouse within ``BUILD_RETRY_S`` (torchft's error).
        RuntimeError: no lighthouse is known at all (see ``LighthouseSource.read``).
    """

    def __init__(self, spec: TrainerSpec, live: LiveState, rank: int, world: int, group: int, job: str,
                 stop: StopFlag | None = None, lighthouse: LighthouseSource | None = None) -> None:
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        # gloo on CPU; NCCL when the model is on CUDA (not exercised by the CPU test suite)
        base = ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo

        abandoned = Abandoned()

        class _EpochPG(base):  # type: ignore[valid-type,misc]  # base: gloo or NCCL, chosen at run time
            """Store keys under the lighthouse epoch: a new lighthouse restarts quorum ids.

            ``stuck``: a collective given up on (``FTGroup.abandon``); at the next reconfiguration its
            backend is detached and held (``Abandoned``) instead of aborted, which would block.
            """
            epoch = 0
            stuck: Any = None

            def configure(self, store_addr: str, *args, **kwargs) -> None:
                self.detach_stuck()
                super().configure(f"{store_addr}/lh{self.epoch}", *args, **kwargs)

            def abort(self, *args, **kwargs) -> None:
                if not self.detach_stuck():
                    super().abort(*args, **kwargs)

            def detach_stuck(self) -> bool:
                work, self.stuck = self.stuck, None
                backend: Any = getattr(self, "_pg", None)
                if work is None or backend is None or work.is_completed():
                    return False
                abandoned.hold(backend, work)
                self._pg = None
                return True

        self.spec, self.live, self.rank, self.world, self.group, self.job = spec, live, rank, world, group, job
        self.stop = stop or StopFlag()
        self.lighthouse = lighthouse or LighthouseSource.from_environ()
        self.timeout = timedelta(seconds=spec.fault.timeout)
        self.pg = _EpochPG(timeout=self.timeout)
        self.nccl = base is ProcessGroupNCCL
        self.abandoned = abandoned
        self.watch: SilentPeerWatch | None = None
        self.quorum_at: float | None = None     # when this step's quorum formed (time.monotonic)
        self._manager: Manager | None = None
        self.epoch = -1
        self.rebuilds = 0
        # standing still longer than heartbeat_timeout: the others may have moved on without this group
        self.freeze = FreezeWatch(spec.fault.heartbeat_timeout)
        self.build()

    @property
    def manager(self) -> Manager:
        """This rank's current Manager."""
        if self._manager is None:
            raise RuntimeError("the torchft Manager is not built")
        return self._manager

    def build(self, state: dict[str, Any] | None = None) -> None:
        """Make this rank's Manager (collective within the group).

        Rank 0 runs the group's ManagerServer, which must reach the lighthouse: it retries (re-reading
        the address) for ``BUILD_RETRY_S`` while a new lighthouse is elected, then publishes the
        manager address in the group's store and broadcasts the lighthouse (address, epoch), so every
        rank of the group configures its process groups under the same epoch. The others make theirs
        after the broadcast: the store outlives a torchrun restart, so an earlier read could be stale.
        """
        from torchft import Manager

        f, job = self.spec.fault, self.job

        def make(address: str) -> Manager:
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
                    self._manager = make(address)
                    break
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise
                    get_logger("trainer").warning("ft_lighthouse_unreachable", address=address,
                                                  error=str(exc).splitlines()[0][:200])
                    self._sleep(1.0)
            box: list[Any] = [address, epoch]
            dist.broadcast_object_list(box, src=0)
        else:
            box = [None, None]
            dist.broadcast_object_list(box, src=0)
            self._manager = make(box[0])
        self.epoch = int(box[1])
        self.pg.epoch = self.epoch
        manager = self._manager
        self.watch = SilentPeerWatch(str(box[0]), self.spec.fault.heartbeat_timeout, self.epoch, self.lighthouse.epoch,
                                     lambda: int(manager._quorum_id), own=f"{self.job}_rg{self.group}:")

    def rebuild(self, log: Any, why: str) -> None:
        """Shut the Manager down, wait (``rebuild_wait``) for a new lighthouse epoch or the lighthouse's
        answer, build a new one (collective).

        Args:
            log: the logger to report on.
            why: the reason, for the log.

        Raises:
            StopRequested: the worker was asked to stop meanwhile.
        """
        old = self._manager
        state = old.state_dict() if old is not None else None
        if old is not None:
            try:
                old.shutdown(wait=False)
            except Exception as exc:  # noqa: BLE001 - the old manager may be half dead
                log.warning("ft_manager_shutdown_failed", error=str(exc))
        started = time.monotonic()
        while True:
            wait, waited = rebuild_wait(built_epoch=self.epoch, epoch=self.lighthouse.epoch(),
                                        answers=self._lighthouse_answers, waited_s=time.monotonic() - started)
            if not wait:
                break
            self._sleep(REBUILD_POLL_S)
        self.rebuilds += 1
        self.build(state)
        log.warning("ft_manager_rebuilt", reason=why, waited=waited, waited_s=round(time.monotonic() - started, 2),
                    epoch=self.epoch, rebuilds=self.rebuilds, step=self.manager.current_step())

    def start_quorum(self) -> None:
        """``manager.start_quorum()``, abandoned when the lighthouse moves while it waits.

        A dead lighthouse is not reported to the waiting client: it would wait out
        ``fault.quorum_timeout``. The call runs in a helper thread instead, and a new
        lighthouse epoch (seen after ``MOVED_GRACE_S``, so that a quorum that was about to
        complete on the old one is not cut short) raises ``LighthouseMoved``; an epoch that
        moved before the quorum starts raises it at once.
        """
        epoch = self.lighthouse.epoch()
        if epoch not in (self.epoch, -1):     # moved already (seen while the last step waited): no quorum on the old one
            raise LighthouseMoved(f"lighthouse epoch {self.epoch} -> {epoch} before a quorum")
        manager, done = self.manager, threading.Event()
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                manager.start_quorum()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                done.set()

        self.quorum_at = None
        threading.Thread(target=run, name="ft-quorum", daemon=True).start()
        started = time.monotonic()
        while not done.wait(0.2):
            if self.stop.requested:
                raise StopRequested()
            if time.monotonic() - started > MOVED_GRACE_S and self.lighthouse.epoch() not in (self.epoch, -1):
                raise LighthouseMoved(f"lighthouse epoch {self.epoch} -> {self.lighthouse.epoch()} during a quorum")
        if "error" in box:
            raise box["error"]
        self.quorum_at = time.monotonic()

    def check_alone(self, previous: int | None, since: float | None, log: Any) -> None:
        """After a quorum: alone right after this process stood still, wait for the agent's lighthouse
        file to move (``stale_lighthouse``), up to ``LIGHTHOUSE_WAIT_S``.

        Args:
            previous: the previous quorum's participants.
            since: when the previous quorum formed (monotonic).
            log: the logger.

        Raises:
            LighthouseMoved: the file moved: this quorum is on a stale lighthouse.
            StopRequested: the worker was asked to stop meanwhile.
        """
        d = decide_alone(participants=self.manager.num_participants(), previous=previous,
                         frozen_s=self.freeze.frozen_since(since), heartbeat_timeout=self.spec.fault.heartbeat_timeout,
                         agent_file=self.epoch > 0)
        if not d.wait:
            return
        log.warning("ft_alone_after_freeze", reason=d.reason, wait_s=LIGHTHOUSE_WAIT_S)
        deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
        while time.monotonic() < deadline:
            if self.lighthouse.epoch() not in (self.epoch, -1):
                raise LighthouseMoved(f"lighthouse epoch {self.epoch} -> {self.lighthouse.epoch()}: the quorum of this "
                                      "group alone was on a stale lighthouse")
            self._sleep(0.2)
        log.warning("ft_training_alone", reason=f"the lighthouse file did not move in {LIGHTHOUSE_WAIT_S:g}s")

    def await_collective(self, work: Any) -> bool:
        """Wait for a cross-group collective of the Manager; give it up if a quorum member goes silent.

        Args:
            work: what ``manager.allreduce`` returned.

        Returns:
            True when it completed (``work.wait()`` is then immediate); False when it was given up:
            the step's error is reported to the Manager (``should_commit`` is False on this group)
            and the collective abandoned (see ``marind.trainer.ft.abort``).
        """
        inner = getattr(work, "_work", None)     # torchft's _ManagedWork wraps the backend's work
        if inner is None or self.watch is None:
            return True
        decision = self.watch.wait(wait_slice(inner), since=self.quorum_at)
        if not decision.abort:
            return True
        self.manager.report_error(PeerSilent(decision.reason))
        if inner.is_completed():
            return False             # completed late, after the others went on: not committed (decide_late)
        if self.nccl:
            self.pg.abort()          # NCCL: the pending work fails at once
        else:
            self.pg.stuck = inner    # gloo: detached at the next reconfiguration
        return False

    def _lighthouse_answers(self) -> bool:
        """Whether the lighthouse of the current file (or env) answers its status within one poll
        of ``rebuild``'s wait (a silent one must not hold off the next look at the epoch)."""
        try:
            address, _ = self.lighthouse.read()
        except RuntimeError:
            return False
        return read_status(address, timeout=REBUILD_POLL_S) is not None

    def _sleep(self, seconds: float) -> None:
        if self.stop.requested:
            raise StopRequested()
        time.sleep(seconds)

    def status(self) -> dict[str, Any]:
        """The torchft fields of the progress record (``marind.core.progress.ProgressRecord``)."""
        m = self.manager
        return {"replica_group": self.group, "participants": m.num_participants(),
                "replica_rank": m.participating_rank(), "quorum_id": m._quorum_id,
                "lighthouse_epoch": self.epoch, "manager_rebuilds": self.rebuilds}


def allreduce_grads(manager: Manager, params: list[torch.nn.Parameter], ft: FTGroup | None = None) -> None:
    """Average the local gradient shards across replica groups in one flat all-reduce.

    Args:
        manager: this group's Manager (its all-reduce averages over the quorum's participants).
        params: the model's parameters; those without a gradient are left out.
        ft: this group's holder: the all-reduce is given up when a quorum member goes silent
            (``FTGroup.await_collective``); the gradients are then left local and the step is
            not committed.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = manager.allreduce(flat)
    if ft is not None and not ft.await_collective(work):
        return
    work.wait()
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n

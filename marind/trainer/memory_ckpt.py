"""The trainer's memory checkpoints (``[checkpoint] memory_every``; docs/design.md §4, "Memory checkpoints").

Every ``memory_every`` steps the state is saved into the memory tier (``ckpt_store.MemoryTier``:
each rank's part in its host's memory and in the next host's, committed like a durable
checkpoint), beside the durable saves of ``every_steps``. A restart restores the newest step
that is whole on the live hosts when it is at least as new as the durable store's newest,
and otherwise the durable one; when a newer memory step was lost with a replica pair, the
fallback is said (``pick_restore``'s reason: the ``checkpoint_memory_fallback`` log line).

At start the memory a host needs (its ranks' snapshots plus the replica it keeps for the
previous host, for the kept step and the one in flight) is checked against the host's
available memory (``memory_plan``): a setting that does not fit is refused with the figures.
The decisions are pure functions (``pick_restore``, ``memory_plan``), tested without processes.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_store import (
    CheckpointError,
    CheckpointSaveFailed,
    MemoryTier,
    PendingSave,
    all_gather_json,
    all_ranks_ok,
    memory_fits,
)
from ckpt_store import memory_needed as tier_memory_needed
from marind.core import workerenv as WE
from marind.core.errors import SpecError
from marind.core.lease_file import lease_path
from marind.core.log import get_logger

log = get_logger(__name__)
#: committed memory steps kept (plus the one being written)
KEPT = 1


@dataclass(frozen=True)
class RestorePick:
    """Where a restart restores from: ``source`` "memory", "durable" or "none"; ``step``; ``reason``;
    ``fallback``: a newer memory step existed but is not whole on the live hosts."""

    source: str
    step: int | None
    reason: str
    fallback: bool = False
    lost_step: int | None = None

    def record(self) -> dict[str, Any]:
        """The progress record's ``restore`` field (the agent's ``checkpoint_memory_fallback`` event)."""
        return {"source": self.source, "step": self.step, "reason": self.reason, "fallback": self.fallback,
                "lost_step": self.lost_step}


def pick_restore(memory: list[tuple[int, bool, str]], durable: int | None) -> RestorePick:
    """Which checkpoint a new world restores.

    Args:
        memory: the committed memory steps, ``(step, whole on the live hosts, why not)``.
        durable: the durable store's newest committed step (None: none).

    Returns:
        The newest memory step that is whole when it is at least as new as ``durable`` (a tie
        goes to memory: the faster read), else ``durable``; ``fallback`` when a memory step newer
        than the one chosen could not be restored (its host and its replica lost together).
    """
    whole = [s for s, ok, _ in memory if ok]
    best = max(whole) if whole else None
    if best is not None and (durable is None or best >= durable):
        return RestorePick("memory", best, f"memory step {best} is whole on the live hosts"
                                           + (f" (durable newest: {durable})" if durable is not None else ""))
    floor = max(s for s in (durable, best, -1) if s is not None)
    lost = sorted(((s, why) for s, ok, why in memory if not ok and s > floor), reverse=True)
    source = "durable" if durable is not None else ("memory" if best is not None else "none")
    step = durable if durable is not None else best
    if lost:
        s, why = lost[0]
        where = f"durable step {durable}" if durable is not None else "no checkpoint"
        return RestorePick(source, step, f"memory step {s} cannot be restored ({why}); falling back to {where}",
                           fallback=True, lost_step=s)
    why = f"durable step {durable} is the newest" if durable is not None else "no checkpoint"
    return RestorePick(source, step, why)


def memory_plan(every: int, own_bytes_by_host: dict[str, int], host_order: list[str], host: str,
                available: int) -> tuple[bool, str]:
    """Whether ``host`` has the memory for memory checkpoints every ``every`` steps; and why (the figures).

    Args:
        every: ``[checkpoint] memory_every``.
        own_bytes_by_host: each host's ranks' snapshot bytes together.
        host_order: the hosts in ring order (``ckpt_store``'s node order).
        host: this host.
        available: this host's available memory in bytes (``available_memory``).

    Returns:
        (fits, the one-line figures).
    """
    i = host_order.index(host)
    prev = host_order[i - 1] if len(host_order) > 1 else None
    need = tier_memory_needed(own_bytes_by_host[host], own_bytes_by_host[prev] if prev else 0, KEPT)
    ok, figures = memory_fits(need, available)
    return ok, f"checkpoint.memory_every = {every} on host {host}: {figures}"


def available_memory(base: str) -> int:
    """This host's memory for memory checkpoints: the smaller of MemAvailable and the free space
    of ``base``'s filesystem (a tmpfs may be capped below the memory)."""
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    probe = base
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe or "/")
    free = st.f_bavail * st.f_frsize
    return min(free, avail) if avail is not None else free


def state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a state tree (its local shards)."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def run_name(job: str, url: str) -> str:
    """The memory tier's directory name of a run: its job and durable store (restarts find it)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "job"
    return f"{safe}-{hashlib.sha1(url.encode()).hexdigest()[:10]}"


class MemoryCheckpointer:
    """Memory checkpoints of one world (``open`` is collective; see the module docstring).

    Args:
        every: ``[checkpoint] memory_every`` (> 0).
        base: ``[checkpoint] memory_dir``.
        job: the job's name.
        url: the durable store's URL (names the run's memory).
        optimizer: protected like the durable store's (the async copy overlaps the next step).
    """

    def __init__(self, tier: MemoryTier, every: int, optimizer: Any) -> None:
        self.tier, self.every = tier, every
        self.pending: PendingSave | None = None
        self.last_step: int | None = None
        self.failures = 0
        if hasattr(optimizer, "register_step_pre_hook"):
            tier.store.protect(optimizer)

    @classmethod
    def open(cls, *, every: int, base: str, job: str, url: str, optimizer: Any, state: Any,
             prepare_timeout_s: float | None = None) -> MemoryCheckpointer:
        """Check the memory (``memory_plan`` on every host) and open the tier.

        Raises:
            SpecError: a host lacks the memory (on every rank; the figures in one line).
        """
        host = socket.gethostname()
        name = run_name(job, url)
        mine = {"host": host, "bytes": state_bytes(state), "avail": available_memory(os.path.join(base, name))}
        everyone = all_gather_json(mine)
        order: list[str] = []
        per_host: dict[str, int] = {}
        avail: dict[str, int] = {}
        for e in everyone:
            if e["host"] not in order:
                order.append(e["host"])
            per_host[e["host"]] = per_host.get(e["host"], 0) + int(e["bytes"])
            avail[e["host"]] = int(e["avail"])
        for h in order:
            ok, why = memory_plan(every, per_host, order, h, avail[h])
            if not ok:
                raise SpecError(f"{why}: lower the model's size per host, raise the hosts' memory, "
                                f"or set checkpoint.memory_every = 0")
        run_dir = os.environ.get(WE.RUN_DIR)
        tier = MemoryTier.open(name, base=base, host=host, keep_last=KEPT,
                               fence_file=str(lease_path(run_dir)) if run_dir else None,
                               prepare_timeout_s=prepare_timeout_s)
        return cls(tier, every, optimizer)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def poll(self) -> None:
        """Note a finished memory save (a failure is logged, not fatal)."""
        if self.pending is not None and self.pending.done():
            self._settle()

    def _settle(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except CheckpointSaveFailed as exc:
            self.failures += 1
            log.error("checkpoint_memory_failed", step=pending.step, error=str(exc), failures=self.failures)
            return
        self.last_step = pending.step

    def save(self, step: int, state: dict) -> None:
        """Start an async memory save of ``step`` (a failure is logged; training goes on)."""
        self._settle()
        try:
            self.pending = self.tier.store.save(step, state, async_=True)
        except CheckpointError as exc:    # refused or failed before it started: training goes on
            self.failures += 1
            log.error("checkpoint_memory_failed", step=step, error=str(exc), failures=self.failures)

    def agreed_steps(self) -> list[tuple[int, bool, str]]:
        """The committed memory steps, whole on the live hosts or not, as rank 0 found them (collective)."""
        return [(m.step, m.complete, m.reason) for m in self.tier.agreed_restorable()]

    def drop_newer(self, step: int, rank: int) -> None:
        """Every rank (collective): rank 0 deletes every memory step newer than ``step`` (lost parts,
        or steps a rollback or a durable restore went back past, whose numbers the run will save
        again), then the ranks meet, so a load of the newest memory step loads ``step`` at most."""
        self._settle()
        if rank == 0:
            st = self.tier.store
            for s in st.steps():
                if s > step:
                    try:
                        st.storage.delete_prefix(f"step-{s:010d}")
                    except (OSError, CheckpointError) as exc:
                        log.warning("checkpoint_memory_drop_failed", step=s, error=str(exc))
        all_ranks_ok(True)

    def close(self, clear: bool = False) -> None:
        """Wait for the save in flight, close the tier (``clear``: the run ended, free the host's memory)."""
        try:
            self._settle()
        finally:
            try:
                self.tier.close(clear=clear)
            except CheckpointSaveFailed as exc:
                log.error("checkpoint_memory_failed", error=str(exc))


def open_memory(spec: Any, model: torch.nn.Module, optimizer: Any,
                prepare_timeout_s: float | None) -> MemoryCheckpointer | None:
    """The run's memory checkpoints (collective), or None when ``[checkpoint] memory_every`` is 0
    or there is no durable store. Raises SpecError when a host lacks the memory (the figures)."""
    c = spec.checkpoint
    if not c.memory_every or not c.url:
        return None
    job = os.environ.get(WE.JOB_ID) or spec.job.name
    return MemoryCheckpointer.open(every=c.memory_every, base=c.memory_dir, job=job, url=c.url, optimizer=optimizer,
                                   state={"params": [p for p in model.parameters()] * 3},
                                   prepare_timeout_s=prepare_timeout_s)


def restore_newest(ckpt: Any, memory: MemoryCheckpointer, rank: int) -> tuple[tuple[int, int] | None, RestorePick]:
    """Restore the newest step the live hosts' memory holds whole, or the durable store's when
    that is newer (``pick_restore``); collective. A memory load that fails falls back to the
    durable store (every rank alike: ``load`` agrees its outcome).

    Args:
        ckpt: the run's ``Checkpointer`` (its ``restore`` does the loading, from either store).
        memory: the run's memory checkpoints.
        rank: this rank.

    Returns:
        (``ckpt.restore()``'s (step, data position) or None, the pick and its reason).
    """
    pick = pick_restore(memory.agreed_steps(), ckpt.latest())
    if pick.fallback and rank == 0:
        log.warning("checkpoint_memory_fallback", reason=pick.reason, step=pick.step)
    memory.drop_newer(pick.step if pick.step is not None else -1, rank)
    if pick.source != "memory":
        return (ckpt.restore() if pick.source == "durable" else None), pick
    durable, ckpt.store = ckpt.store, memory.tier.store
    try:
        restored = ckpt.restore()
    except CheckpointError as exc:
        pick = RestorePick("durable", ckpt.latest(), f"memory step {pick.step} failed to load ({exc}); "
                                                     "falling back to the durable store", fallback=True,
                           lost_step=pick.step)
        if rank == 0:
            log.warning("checkpoint_memory_fallback", reason=pick.reason, step=pick.step)
        restored = None
    finally:
        ckpt.store = durable
    if restored is None and pick.source == "durable":
        restored = ckpt.restore()
    elif rank == 0:
        log.info("restored_from_memory", step=pick.step, reason=pick.reason)
    return restored, pick

"""Replica drift (torchft mode): every ``fault.drift_check_every`` committed steps, the replica groups
compare a digest of their state; a group whose state differs is stopped and healed from a good one.

torchft heals a group only when its step count is behind the quorum's (``max_step``): two groups at
the same step are taken to hold the same state. Anything that breaks that silently (a group that
trained a few steps on its own history while cut off, an inexact restore or transfer, a bit flip)
then lasts forever: the groups average the same gradients from then on, so every logged gradient
norm matches while the parameters differ.

The check, after a committed step ``s`` with ``s % every == 0``:

1. every rank digests its local shards of the parameters and the optimizer state
   (:func:`state_digest`: per tensor, integer sums of its bit pattern, computed on the device;
   order-independent, so exact on any backend; one ulp anywhere changes it);
2. rank ``r`` of each group writes ``(present, step, digest)`` into its replica rank's slot of a
   small int64 vector; one SUM all-reduce across the quorum (the Manager's, given up like the
   gradients' when a member goes silent) gives every group every slot;
3. :func:`decide_drift` (pure) names the drifted replica ranks: among the groups at the common
   step, those whose digest is not the majority's (a tie keeps the lowest replica rank's state);
4. the group agrees (one MAX all-reduce in its own world: a drift on any rank's shard is the
   group's); a drifted group logs ``replica_drift`` and moves its Manager's step back by one, so
   the next quorum sees it behind and torchft heals it from a group at the quorum's step (its own
   recovery path: the peer's parameters and optimizer state); ``replica_drift_healed`` follows.

The progress record carries the last finding (``drift``: step, reason, healed); the agent turns
it into the job's ``replica_drift`` event (``marind.agent.run_progress``).

Test hook: ``MARIND_TEST_FT_DRIFT=GROUP:STEP`` moves one parameter element of replica group GROUP
by one ulp right after step STEP is committed.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from marind.core.log import get_logger

if TYPE_CHECKING:
    from marind.trainer.ft.group import FTGroup

TEST_FT_DRIFT = "MARIND_TEST_FT_DRIFT"
SLOT = 3                   # per replica rank: present, step, digest
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """(sum, sum of squares) of ``t``'s bit pattern as int64 (wrapping), on ``t``'s device."""
    flat = _local(t).detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    words = flat.contiguous().view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    return torch.stack([words.sum(), (words * words).sum()])


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """A 62-bit digest of this rank's local shards of the parameters and the optimizer state.

    Integer sums of each tensor's bit pattern (order-independent: exact whatever the reduction
    order), hashed together with the tensor names; equal across groups iff they hold the same
    state (up to an improbable collision). One device-to-host copy of 2 numbers per tensor.
    """
    names, sums = [], []
    for name, p in model.named_parameters():
        names.append(name)
        sums.append(_tensor_sums(p))
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                names.append(f"{name}/{key}")
                sums.append(_tensor_sums(value))
    h = hashlib.sha256("\n".join(names).encode())
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 2


@dataclass(frozen=True)
class DriftDecision:
    """Which replica ranks drifted at the checked step, and why (for the log and the event)."""

    drifted: tuple[int, ...]
    reason: str


def decide_drift(slots: Sequence[tuple[int, int] | None]) -> DriftDecision:
    """Name the replica ranks whose state differs from the others' at the same step.

    Args:
        slots: per replica rank, ``(step, digest)``, or None where that rank reported nothing
            (not participating, or its check was given up).

    Returns:
        The drifted replica ranks (empty: none) and the reason. Only the groups at the step most
        of them reported are compared (a group behind is torchft's to heal). The digest most of
        them hold is the good state; with no majority (two groups, or a split), the lowest replica
        rank's digest is kept and every group whose digest differs from it heals from it.
    """
    present = [(r, s) for r, s in enumerate(slots) if s is not None]
    if len(present) < 2:
        return DriftDecision((), "fewer than two groups to compare")
    steps = Counter(step for _, (step, _) in present)
    step = max(steps, key=lambda s: (steps[s], s))
    at = [(r, digest) for r, (s, digest) in present if s == step]
    if len(at) < 2:
        return DriftDecision((), f"fewer than two groups at step {step}")
    counts = Counter(digest for _, digest in at)
    if len(counts) == 1:
        return DriftDecision((), f"{len(at)} groups agree at step {step}")
    (top, n_top), (_, n_next) = counts.most_common(2)
    if n_top > n_next:
        good, how = top, f"{n_top} of {len(at)} groups agree"
    else:
        good = at[0][1]
        how = f"no majority among {len(at)} groups: replica rank {at[0][0]}'s state kept"
    drifted = tuple(r for r, digest in at if digest != good)
    return DriftDecision(drifted, f"state of replica rank(s) {list(drifted)} differs at step {step} ({how})")


def parse_drift_hook(value: str | None) -> tuple[int, int] | None:
    """``MARIND_TEST_FT_DRIFT`` = ``GROUP:STEP`` -> (group, step); None when unset.

    Raises:
        ValueError: not two integers separated by ``:``.
    """
    if not value:
        return None
    try:
        group, step = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"{TEST_FT_DRIFT} = {value!r} must be GROUP:STEP (two integers)") from None
    return group, step


@torch.no_grad()
def nudge_one_ulp(model: torch.nn.Module) -> str:
    """Move the first element of the first parameter by one ulp (the test hook); its name."""
    name, p = next(iter(model.named_parameters()))
    t = _local(p.data).reshape(-1)
    t[0] = torch.nextafter(t[0], torch.tensor(float("inf"), dtype=t.dtype, device=t.device))
    return name


class DriftCheck:
    """One group's replica-drift check (see the module docstring).

    Args:
        every: ``fault.drift_check_every``; 0 turns the check off.
        group: this group's slot (for the test hook).
        rank: rank within the group's torch world (rank 0 logs).
    """

    def __init__(self, every: int, group: int, rank: int) -> None:
        self.every, self.group, self.rank = every, group, rank
        self.hook = parse_drift_hook(os.environ.get(TEST_FT_DRIFT))
        self.pending: int | None = None         # the step a drifted group must be healed to
        self.finding: dict[str, Any] | None = None
        self.checks = 0

    def after_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ft: FTGroup, *,
                   attempted: int, step: int, device: torch.device) -> bool:
        """After the step ``attempted`` (committed when ``step == attempted``): the test hook, then the
        check when ``attempted`` is a multiple of ``every``.

        The quorum's participants all attempted the same step (a group behind healed at the quorum), so
        they all take part in the check's collective, committed or not (a group that did not commit
        reports ``attempted - 1`` and is not compared); one whose gradient all-reduce failed skips it,
        as torchft skips every collective of an errored step.

        Returns:
            True when this group drifted: its Manager's step was moved back to ``step - 1``.
        """
        if self.hook is not None and self.hook == (self.group, step) and step == attempted:
            name = nudge_one_ulp(model)
            get_logger("trainer").warning("test_drift_injected", step=step, param=name)
        if self.every <= 0 or attempted % self.every:
            return False
        manager = ft.manager
        n, me = manager.num_participants(), manager.participating_rank()
        vec = torch.zeros(SLOT * max(n, 1), dtype=torch.int64, device=device)
        if me is not None and me < n:
            vec[SLOT * me:SLOT * me + SLOT] = torch.tensor([1, step, state_digest(model, optimizer)], device=device)
        decision = DriftDecision((), "this group's step failed: no check")
        if manager.errored() is None:
            decision = self._compare(ft, vec, n)
        self.checks += 1
        mine = torch.tensor([1.0 if me is not None and me in decision.drifted else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if float(mine) == 0 or step != attempted:
            return False
        manager.load_state_dict({"step": step - 1, "batches_committed": manager.batches_committed()})
        self.pending = step
        self.finding = {"step": step, "reason": decision.reason or "another rank of this group drifted",
                        "healed": False}
        if self.rank == 0:
            get_logger("trainer").warning("replica_drift", step=step, reason=self.finding["reason"],
                                          action="heal from a peer at the next quorum")
        return True

    @staticmethod
    def _compare(ft: FTGroup, vec: torch.Tensor, n: int) -> DriftDecision:
        """The check's all-reduce across the quorum (given up like the gradients'), then the decision."""
        work = ft.manager.allreduce(vec, reduce_op=_sum_op())
        if not ft.await_collective(work) or ft.manager.errored() is not None:
            return DriftDecision((), "the check's all-reduce was given up")
        work.wait()
        got = vec.tolist()
        return decide_drift([(got[SLOT * r + 1], got[SLOT * r + 2]) if got[SLOT * r] == 1 else None
                             for r in range(n)])

    def after_quorum(self, step: int, participants: int) -> None:
        """The next quorum formed at ``step``: a drifted group healed when it is back at its step."""
        if self.pending is None or self.finding is None:
            return
        healed = step >= self.pending
        if self.rank == 0:
            log = get_logger("trainer")
            if healed:
                log.info("replica_drift_healed", step=step, drifted_at=self.pending)
            else:
                log.warning("replica_drift_not_healed", step=step, drifted_at=self.pending, participants=participants,
                            reason="no group at the drifted step in this quorum: training on")
        self.finding = {**self.finding, "healed": healed}
        self.pending = None

    def progress_fields(self) -> dict[str, Any]:
        """``drift`` for the progress record once there was a finding."""
        return {"drift": dict(self.finding)} if self.finding is not None else {}


def _sum_op() -> Any:
    from torch.distributed import ReduceOp
    return ReduceOp.SUM

"""How the ranks of a save or a load agree (docs/design.md §4): the few collectives the store runs.

All run in the caller's thread on the default process group, and only when
there is more than one rank: every rank must call the same ones in the same
order. A save agrees on what it saves and that every rank is ready to (``agree_layout``:
one all-reduce of a digest and a flag, before anything is written); a load lists the steps on rank 0 only
(``rank0_steps``: one broadcast) and agrees on each step's outcome
(``agree_outcome``: the worst over the ranks wins), so every rank takes the
same branch and none is left waiting in a collective; each rank of a load reads
1/W of a step's object lists and they all-gather them (``part_share``); before a save, the
ranks agree on the outcome of the save in flight (``agree_settled``: rounds of one all-reduce
until ``settle_decision`` decides; a failure on one rank is a failure on all). ``layout_difference``
and ``settle_decision`` are pure functions.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ckpt_store.errors import CheckpointError
from ckpt_store.format.manifest import PartShare
from ckpt_store.format.plan import mesh_ranks

#: a step's load on one rank; the worst over the ranks wins (``agree_outcome``)
LOAD_OK, LOAD_GONE, LOAD_CORRUPT, LOAD_FATAL = 0, 1, 2, 3


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    """Is there a process group of more than one rank?"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait for every rank (foreground, default group); nothing with one rank."""
    if distributed():
        dist.barrier()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def agree_outcome(outcome: int) -> int:
    """The worst ``outcome`` (``LOAD_*``) over all ranks (foreground, default group): every
    rank then takes the same branch (return, try an older step, or raise)."""
    if not distributed():
        return outcome
    flag = torch.tensor([outcome], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def layout_rows(step: int, tensors: dict) -> list:
    """What every rank of a save must agree on: the step, and each array's name, global
    shape, dtype, mesh shape and placements (not the mesh's ranks: sibling sub-meshes differ)."""
    rows: list = [step]
    for name in sorted(tensors):
        t = tensors[name]
        where = None
        if isinstance(t, DTensor):
            where = [list(mesh_ranks(t.device_mesh)[1]), [str(p) for p in t.placements]]
        rows.append([name, list(t.shape), str(t.dtype), where])
    return rows


def agree_layout(step: int, tensors: dict, ready: bool = True) -> bool:
    """Refuse, on every rank and before anything is written, a save whose ranks disagree;
    and tell every rank whether all of them are ``ready`` (their step directory prepared in time).

    One all-reduce of a 62-bit digest of ``layout_rows`` and the ``ready`` flag; only when
    the digests differ (and every rank is ready) do the ranks exchange the rows themselves,
    to name the difference. Ranks that save different steps, or hold different arrays (every
    rank must present every array, sharded or replicated; a pipeline stage presents the
    other stages' arrays as DTensors placed on their holders' ranks, of which it writes
    nothing, as ``marind.trainer.parallel.pipeline_ckpt`` does), would otherwise commit a checkpoint
    with holes, or wait on each other in a collective that never matches.

    Returns:
        True when every rank was ready (then the layouts agree); False when some rank was
        not (the layouts are not compared: the save is off on every rank anyway).

    Raises:
        CheckpointError: on every rank, naming the first difference.
    """
    rows = layout_rows(step, tensors)
    raw = json.dumps(rows).encode()
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") >> 2
    both = torch.tensor([digest, -digest, 1 if ready else 0], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    if not int(both[2]):
        return False
    if int(both[0]) == -int(both[1]):
        return True
    raise CheckpointError(f"checkpoint step {step}: the ranks disagree on what they save "
                          f"({layout_difference(all_gather_json(rows))}); every rank must call save() "
                          "with the same step and the same arrays (shapes, dtypes, placements)")


#: how often the ranks of a ``settle`` compare their save in flight (one all-reduce each time)
SETTLE_POLL_S = 0.05
#: ``agree_settled``'s outcomes
SETTLED, SETTLE_FAILED, SETTLE_BUSY, SETTLE_TIMEOUT = "settled", "failed", "busy", "timeout"


def settle_decision(failed: bool, running: bool, busy_late: bool, timeout_late: bool) -> str | None:
    """What the ranks do about the save in flight, from flags taken over every rank (pure).

    Args:
        failed: it failed on some rank.
        running: it is still running on some rank.
        busy_late: some rank waited past the point where it gives up waiting (the caller skips).
        timeout_late: some rank waited past its timeout (an error).

    Returns:
        ``SETTLE_FAILED`` (it failed somewhere: it failed everywhere; the ranks still in it stop),
        ``SETTLED`` (over everywhere, and committed), ``SETTLE_TIMEOUT``, ``SETTLE_BUSY``, or None: wait
        and compare again. A failure wins over everything: no rank waits for a commit that will not come.
    """
    if failed:
        return SETTLE_FAILED
    if not running:
        return SETTLED
    if timeout_late:
        return SETTLE_TIMEOUT
    if busy_late:
        return SETTLE_BUSY
    return None


def agree_settled(local: Callable[[], tuple[bool, bool, bool, bool]], poll_s: float = SETTLE_POLL_S) -> str:
    """Wait, with every rank, until ``settle_decision`` over all ranks decides (foreground, default group).

    Each round calls ``local()`` for this rank's ``(failed, running, busy_late, timeout_late)`` and
    runs one all-reduce (MAX) of them, so every rank decides the same in the same round and leaves
    the loop together: no collective is left unmatched, whichever rank saw a failure.

    Returns:
        The decision (``SETTLED``, ``SETTLE_FAILED``, ``SETTLE_BUSY``, ``SETTLE_TIMEOUT``).
    """
    while True:
        flags = [int(f) for f in local()]
        if distributed():
            t = torch.tensor(flags, dtype=torch.int32, device=_collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flags = [int(v) for v in t.tolist()]
        decision = settle_decision(*(bool(f) for f in flags))
        if decision is not None:
            return decision
        time.sleep(poll_s)


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when ``ok`` is True on every rank (one all-reduce, MIN; no collective alone)."""
    if not distributed():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag[0]))


def layout_difference(per_rank: list) -> str:
    """The first difference between the ranks' ``layout_rows`` (``per_rank[r]``: rank r's), in words."""
    steps = {r: rows[0] for r, rows in enumerate(per_rank)}
    if len(set(steps.values())) > 1:
        return f"steps by rank: {steps}"
    tables = [{row[0]: row[1:] for row in rows[1:]} for rows in per_rank]
    for name in sorted(set().union(*tables)):
        holders = [r for r, table in enumerate(tables) if name in table]
        if len(holders) < len(tables):
            return f"array {name!r} is held by ranks {holders} only"
        kinds = {json.dumps(table[name]) for table in tables}
        if len(kinds) > 1:
            first = tables[0][name]
            other = next(r for r, table in enumerate(tables) if table[name] != first)
            return f"array {name!r} is {first} on rank 0 but {tables[other][name]} on rank {other}"
    return "their digests differ"


def all_gather_json(obj: Any) -> list:
    """Every rank's ``obj`` (JSON), through two all-gathers of byte tensors (no pickle)."""
    device = _collective_device()
    data = json.dumps(obj).encode()
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = max(int(s) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(b[:int(s)].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]


def part_share() -> PartShare | None:
    """How the ranks of a load share the reading of a step's object lists (``read_manifest``):
    each reads 1/W of them and ``all_gather_json`` hands them round. None with one rank."""
    if not distributed():
        return None
    return PartShare(dist.get_rank(), dist.get_world_size(), all_gather_json)


def rank0_steps(list_steps: Callable[[], list[int]] | None) -> list[int]:
    """Rank 0's committed steps, on every rank (``list_steps``: rank 0's lister, None elsewhere).

    One listing for the whole job instead of one per rank (on S3 a LIST plus a HEAD per
    step, times every rank), and every rank then tries the same steps in the same order:
    listings taken a moment apart can differ, and a load whose ranks walk different lists
    would leave some of them waiting in a collective.

    Raises:
        Whatever rank 0's listing raised, on rank 0; CheckpointError on the other ranks.
    """
    if not distributed():
        return list_steps() if list_steps is not None else []   # a single rank is rank 0: it lists
    device = _collective_device()
    steps: list[int] = []
    error = None
    if list_steps is not None:
        try:
            steps = list_steps()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
    count = torch.tensor([-1 if error is not None else len(steps)], dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    if int(count.item()) < 0:
        if error is not None:
            raise error
        raise CheckpointError("rank 0 could not list the checkpoint steps (see its log)")
    buf = torch.tensor(steps if list_steps is not None else [0] * int(count.item()), dtype=torch.int64,
                       device=device)
    if buf.numel():
        dist.broadcast(buf, src=0)
    return [int(s) for s in buf.tolist()]

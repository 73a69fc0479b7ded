"""The agent's decisions as pure functions: plain data in, the decision *and its reason* out.

Nothing here touches etcd, a process or the clock: the caller passes
``now`` where time matters and does what the decision says
(``marind.agent.daemon``, ``marind.agent.run_monitor`` and its parts
``hang_kill`` and ``node_losses``, ``marind.agent.liveness``). The same
pattern as ``hang.HangDetector`` and ``lifecycle.transition``.

* ``admit``: does a job get this node's slots now (start / wait / too big)?
* ``on_terminal_state``: a job is terminal in etcd; stop its torchrun here now,
  or give it the success grace period?
* ``classify_workers``: are torchrun's workers a new rendezvous round?
* ``workers_running``: has a restarted round started training?
* ``failure_restarts``: torchrun logged a failed round; does a restart follow it?
* ``after_exit`` / ``after_group_failure``: torchrun exited; restart it once
  etcd is back, or move the job to SUCCEEDED / FAILED, or (torchft) leave
  the job to the other replica groups?
* ``on_hang``: dump the workers' stacks, wait for the dump, kill them.
* ``replica_group_lost``: a torchft node's workers belong to a group the node left.
* ``on_node_loss``: a node of the job lost its lease; restart this node's workers into a
  new round now, only drop it from the rendezvous, or wait (training goes on)?
* ``fence_due``: this node's lease must have expired; stop its workers (fence) or not?

The data network's loss (a node whose lease lives on) has its own verdicts in
``marind.agent.liveness.data_decisions`` (``cut_off``, ``on_data_loss``, ``commit_fence_due``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from marind.control.lifecycle import JobState

#: A job SUCCEEDED elsewhere: how long this node's torchrun may take to finish too.
SUCCESS_GRACE_S = 30.0
#: A restarted round counts as running after this long even if no worker reports training.
RESTART_RUNNING_FALLBACK_S = 10.0
#: Between the stack dump (SIGUSR1) and the kill (SIGKILL) of hung workers.
HANG_DUMP_WAIT_S = 2.0
#: The phases of a worker that mean its round is running.
RUNNING_PHASES = ("training", "checkpointing", "done")


# ---------------------------------------------------------------- slots

class Admission(str, Enum):
    """``admit``'s verdict."""

    START = "start"          # the job fits in the free slots
    WAIT = "wait"            # not now: other jobs hold the slots
    TOO_BIG = "too_big"      # never on this node: it has fewer slots than the job needs


def admit(nproc_per_node: int, used: int, slots: int) -> tuple[Admission, str]:
    """Does a job that needs ``nproc_per_node`` slots start on a node?

    Args:
        nproc_per_node: the slots (processes) the job needs on each node.
        used: slots held by the jobs this node runs already.
        slots: the node's slots.

    Returns:
        The admission and why.
    """
    if nproc_per_node > slots:
        return Admission.TOO_BIG, f"needs {nproc_per_node} slots; the node has {slots}"
    if used + nproc_per_node > slots:
        return Admission.WAIT, f"needs {nproc_per_node} slots; {used} of {slots} are in use"
    return Admission.START, f"{nproc_per_node} slots of {slots - used} free"


# ---------------------------------------------------------------- a job that is terminal in etcd

@dataclass(frozen=True)
class TerminalDecision:
    """What to do with this node's run of a job that is terminal in etcd."""

    end: bool                       # stop the torchrun now
    terminal_since: float | None    # when the grace period began (kept in the run)
    reason: str


def on_terminal_state(state: JobState, *, torchrun_running: bool, terminal_since: float | None,
                      now: float, grace_s: float = SUCCESS_GRACE_S) -> TerminalDecision:
    """A job is terminal in etcd while this node still runs it.

    SUCCEEDED on another node: this node's torchrun gets ``grace_s`` to finish on its own
    (its last steps and final save). Any other terminal state, or a torchrun that has
    exited: stop now.

    Args:
        state: the job's (terminal) state.
        torchrun_running: whether this node's torchrun is still running.
        terminal_since: when this node first saw the job SUCCEEDED with its torchrun running.
        now: the current time.
        grace_s: the grace period.

    Returns:
        Whether to stop now, the grace period's start to keep, and why.
    """
    if state == JobState.SUCCEEDED and torchrun_running:
        since = terminal_since or now
        if now - since < grace_s:
            return TerminalDecision(False, since, f"job SUCCEEDED elsewhere; torchrun may finish "
                                                  f"({now - since:.0f}s of {grace_s:.0f}s)")
        return TerminalDecision(True, since, f"job is {state.value}")
    return TerminalDecision(True, terminal_since, f"job is {state.value}")


# ---------------------------------------------------------------- rendezvous rounds

class Generation(str, Enum):
    """``classify_workers``' verdict."""

    SAME = "same"            # the round this node knows (or no workers)
    SPAWNING = "spawning"    # more workers of the current round
    NEW = "new"              # workers of a new round: torchrun (re)started them


def classify_workers(launched: frozenset[int], known: frozenset[int]) -> tuple[Generation, frozenset[int], str]:
    """Are torchrun's children of a new round?

    Args:
        launched: pids of torchrun's live worker children (stable while a round lives).
        known: the pids of the current round so far.

    Returns:
        The verdict, the current round's pids after it, and why.
    """
    if not launched or launched <= known:
        return Generation.SAME, known, "no new worker"
    if not known or launched.isdisjoint(known):
        return Generation.NEW, launched, "none of the workers belongs to the previous round"
    return Generation.SPAWNING, known | launched, "workers of this round still spawning"


def workers_running(phases: Iterable[str], *, awaiting_since: float, now: float,
                    fallback_s: float = RESTART_RUNNING_FALLBACK_S) -> tuple[bool, str]:
    """Has a restarted round started running (the job goes back to RUNNING)?

    Args:
        phases: the phases of the round's workers' progress records.
        awaiting_since: when the round started.
        now: the current time.
        fallback_s: after this long the round counts as running without a report.

    Returns:
        Whether it runs, and why.
    """
    phases = list(phases)
    if any(p in RUNNING_PHASES for p in phases):
        return True, "a worker reports training"
    if now - awaiting_since > fallback_s:
        return True, f"no training report {fallback_s:.0f}s after the restart"
    return False, "waiting for a worker to report training"


def failure_restarts(failures: int, max_restarts: int) -> tuple[bool, str]:
    """torchrun reported its ``failures``-th failed round on this node: does a restart follow?

    torchrun restarts its workers after each of the first ``max_restarts`` failures (a round
    restarted because the nodes changed does not count); the next failure ends it.

    Args:
        failures: failed rounds this torchrun has reported so far, this one included.
        max_restarts: the job's ``job.max_restarts``.

    Returns:
        (restart, why).
    """
    if failures <= max_restarts:
        return True, f"failure {failures}: torchrun restarts the workers ({max_restarts} at most)"
    return False, f"failure {failures} after {max_restarts} restarts: torchrun gives up"


# ---------------------------------------------------------------- torchrun exited

class ExitAction(str, Enum):
    """What a torchrun exit means for the job."""

    RETRY = "retry"          # etcd was away: start the job again here once it is back
    SUCCEED = "succeed"      # the job SUCCEEDED
    FAIL = "fail"            # the job FAILED
    LEAVE = "leave"          # torchft: this node's group failed; the others train on


@dataclass(frozen=True)
class ExitDecision:
    """What a torchrun exit means for the job."""

    action: ExitAction
    reason: str
    etcd_retries: int        # restarts after losing etcd so far, this one included


def after_exit(rc: int, *, node: str, job: str, etcd_down: bool, etcd_retries: int,
               max_restarts: int) -> ExitDecision:
    """torchrun exited with ``rc`` on ``node``: what becomes of the job?

    A non-zero exit while etcd is away is torchrun's rendezvous losing etcd, not the job's
    failure: the job is started again once etcd is back (it resumes from its latest
    checkpoint), at most ``max_restarts`` times.

    Args:
        rc: torchrun's exit code.
        node: this node's name (for the reason).
        job: the job's id (for the reason).
        etcd_down: whether etcd is unreachable now (only asked when ``rc != 0``).
        etcd_retries: restarts after losing etcd so far.
        max_restarts: the job's ``job.max_restarts``.

    Returns:
        The decision; its reason is the one the state change or event carries.
    """
    if rc != 0 and etcd_down:
        etcd_retries += 1
        if etcd_retries <= max_restarts:
            return ExitDecision(ExitAction.RETRY, "etcd unreachable: torchrun exited", etcd_retries)
    if rc == 0:
        return ExitDecision(ExitAction.SUCCEED, f"torchrun exited 0 on {node}", etcd_retries)
    return ExitDecision(ExitAction.FAIL, f"torchrun exited {rc} on {node} (restarts exhausted or the "
                                         f"entrypoint failed); see `marind logs {job}`", etcd_retries)


def after_group_failure(others: Sequence[str] | None) -> tuple[bool, str]:
    """A torchft replica group on this node gave up: does the job go on without this node?

    Args:
        others: the other nodes still in the job (read after this node's record went),
            or None when etcd could not tell.

    Returns:
        (leave, why): True: this node leaves and the other groups train on; False: the job fails.
    """
    if others is None:
        return False, "cannot count the other nodes: the job fails as an elastic one would"
    if not others:
        return False, "no other node is in the job"
    return True, f"the other groups train on ({', '.join(others)})"


# ---------------------------------------------------------------- hangs

class HangAction(str, Enum):
    """``on_hang``'s action for this tick."""

    NONE = "none"            # not hung
    DUMP = "dump"            # hung: SIGUSR1 the workers (stacks into the log), kill them later
    WAIT = "wait"            # the stacks are being dumped
    KILL = "kill"            # SIGKILL the workers now


def on_hang(*, now: float, hung: bool, why: str, kill_at: float | None,
            torchrun_exited: bool) -> tuple[HangAction, str]:
    """One tick of hang handling.

    Args:
        now: the current time.
        hung: the hang detector's verdict (ignored while a dump is pending).
        why: the detector's reason.
        kill_at: when a pending stack dump ends (``now + HANG_DUMP_WAIT_S`` at the dump), or None.
        torchrun_exited: torchrun is gone: a pending kill is due at once.

    Returns:
        The action and why.
    """
    if kill_at is None:
        return (HangAction.DUMP, why) if hung else (HangAction.NONE, why)
    if torchrun_exited:
        return HangAction.KILL, "torchrun exited during the stack dump"
    if now >= kill_at:
        return HangAction.KILL, f"stack dump wait of {HANG_DUMP_WAIT_S:.0f}s over"
    return HangAction.WAIT, f"stack dump for {kill_at - now:.1f}s more"


# ---------------------------------------------------------------- torchft

def replica_group_lost(slot: int | None, launched_slot: int | None, *, stopping: bool) -> tuple[bool, str]:
    """Do this node's workers belong to a replica group the node no longer holds?

    Args:
        slot: the group the node holds now (None: none).
        launched_slot: the group its running torchrun was started in.
        stopping: the torchrun is being stopped anyway.

    Returns:
        (lost, why).
    """
    if stopping or slot == launched_slot:
        return False, f"replica group {launched_slot} held"
    return True, (f"replica group slot {launched_slot} lost; "
                  f"now {slot if slot is not None else 'none'}")


# ---------------------------------------------------------------- node loss and fencing

def stall_window(lease_ttl: float) -> float:
    """Seconds without progress that, with a lost lease, mean the collectives are stuck.

    Half the lease TTL: a node whose lease expired was noticed at the earliest 9/10 TTL after it
    went quiet (keep-alives every TTL/10), so its peers' workers have been stuck that long;
    workers still stepping within it reach their peers (only the control network is gone).
    """
    return lease_ttl / 2


class LossAction(str, Enum):
    """``on_node_loss``'s verdict for one lost node."""

    RESTART = "restart"      # drop it from the rendezvous and restart this node's workers now
    MARK = "mark"            # drop it from the rendezvous; this node's workers are not in a round with it
    WAIT = "wait"            # not yet: this node's workers still make progress


def on_node_loss(*, in_round: bool, workers_running: bool, progress_at: float | None, now: float,
                 stall_s: float, torchft: bool = False, lost: str = "lease expired",
                 stepping: str = "its control network alone is gone") -> tuple[LossAction, str]:
    """A node of the job lost its lease (its record vanished): what does this node do?

    A node in the current round whose lease expired while this node's workers stopped
    making progress is gone from the data network too (power off, panic, a cut link):
    waiting for ``hang_timeout`` and torch's keep-alive would only waste time, so the
    workers restart into a new round at once. Workers that keep stepping still reach it
    (its control network alone is cut): no restart; it keeps training with us.

    Args:
        in_round: the lost node is a participant of the job's current rendezvous round
            (``Membership.in_current_round``).
        workers_running: this node's workers of the current round are running.
        progress_at: when this node's workers last made progress (None: not seen yet).
        now: the current time.
        stall_s: the stall that counts as stuck (``stall_window``).
        torchft: a torchft job: its replica groups heal without restarting this node's.
        lost: what happened to the node, for the restart's reason.
        stepping: what workers that still step mean, for the wait's reason.

    Returns:
        The action and why.
    """
    if torchft:
        return LossAction.MARK, "torchft: the other replica groups go on without it"
    if not in_round:
        return LossAction.MARK, "it ran no workers: only the rendezvous forgets it"
    if not workers_running:
        return LossAction.MARK, "this node's workers are not running: the next round forms without it"
    if progress_at is not None and now - progress_at < stall_s:
        return LossAction.WAIT, f"training goes on (progress {now - progress_at:.1f}s ago): {stepping}"
    stalled = "no progress seen yet" if progress_at is None else f"no progress for {now - progress_at:.1f}s"
    return LossAction.RESTART, f"{lost} and {stalled}: restart into a new round without it"


def fence_due(*, last_renewal: float, ttl: float, now: float, progress_at: float | None,
              stall_s: float, revoked: bool = False) -> tuple[bool, str]:
    """Must this node fence its run of a job (stop its workers, write nothing more for it)?

    Once ``ttl`` has passed since the last successful renewal of the node's lease, the
    lease may have expired and the other nodes may have restarted the job without this
    one. Its workers are stopped then, unless they still make progress: then they still
    reach their peers, no new world has formed (only etcd is away), and they train on.

    Args:
        last_renewal: when the lease was last renewed (the request's send time).
        ttl: the lease's TTL.
        now: the current time.
        progress_at: when the run's workers last made progress (None: not seen yet).
        stall_s: the stall that counts as stuck (``stall_window``).
        revoked: etcd answered that the lease is gone sooner than ``ttl`` after its last
            renewal: the other agents revoked it (``marind.agent.liveness.silence``), so they replaced
            this node's world whatever its workers do now.

    Returns:
        (fence, why).
    """
    since = now - last_renewal
    if revoked:
        return True, f"lease revoked by the other agents ({since:.1f}s after its last renewal): declared lost"
    if since < ttl:
        return False, f"lease renewed {since:.1f}s ago (TTL {ttl:g}s)"
    if progress_at is not None and now - progress_at < stall_s:
        return False, (f"lease not renewed for {since:.1f}s but training goes on "
                       f"(progress {now - progress_at:.1f}s ago): etcd alone is away")
    return True, f"lease not renewed for {since:.1f}s (TTL {ttl:g}s) and the workers are not progressing"

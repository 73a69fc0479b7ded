"""A silent host, declared lost before its lease expires: two independent signals must agree (pure).

A host that loses power, panics or drops off both networks is silent: its
peers' workers wait in a collective and the lease TTL (10 s by default) would
pass before its records vanish. Its peers can tell sooner, from two signals
that a live host cannot lose together without being cut off anyway:

1. its **data endpoint** (``marind.agent.liveness.data_probe``) has not answered this
   node's probes for ``PROBE_SILENT_S`` since the first that failed (a probe
   that timed out waited its 1 s connect timeout already);
2. its **lease** in etcd has gone unrenewed for more than ``silent_window(ttl)``
   of ITS granted TTL (0.4 TTL; renewals come every TTL/10). etcd reports a lease's remaining time in
   whole seconds, truncated, so ``granted - remaining - 1`` seconds have surely
   passed since the last renewal (``unrenewed_for``), never more than the truth.

A host that only lost etcd still answers on the data network; one that only
lost the data network still renews its lease (``data_decisions`` judges it). And
this node's own workers must have made no progress for ``stall_for`` their usual
interval (at least ``STALL_S``): a step completed meanwhile proves the peer's
workers still take part. Only such a stall is acted on early (a restart): with
no workers of this node waiting on it (torchft, another round, none running)
there is no evidence that the peer's workers stopped too, and its lease is left
to expire (``decisions.on_node_loss``).

Safety: a host declared so may be alive and frozen (SIGSTOP, a hypervisor
pause) and come back inside its old lease. Its workers commit only until
``last renewal + silent_window`` (``marind.core.lease_file``: the renewal's
*send* time, so at or before etcd's refresh), and its peers act only once etcd
shows the lease older than that window: by then no commit of the old world can
start. The peer that acts first revokes the lease, so the host cannot renew into
its old world either: its agent sees the lease gone sooner than the TTL allows
(``NodeRegistry.revoked``) and fences every run before it registers anew.
"""

from __future__ import annotations

from marind.agent.decisions import LossAction, on_node_loss

#: the ``node_lost`` cause of a host silent on both networks (declared before its lease expired)
HOST_SILENT = "host_silent"
#: a peer's data endpoint must have been unreachable this long (after its first failed probe)
#: before its lease is asked about
PROBE_SILENT_S = 1.0
#: this node's workers must have made no progress this long (or twice their usual interval)
STALL_S = 2.0


def stall_for(progress_interval: float | None) -> float:
    """How long without progress shows this node's workers wait on a peer: ``STALL_S``, or twice
    the usual time between their progress records when their steps are slower (pure)."""
    return max(STALL_S, 2.0 * progress_interval) if progress_interval else STALL_S


def suspect(down_since: float | None, now: float, probe_s: float = PROBE_SILENT_S) -> bool:
    """Has a peer's data endpoint been unreachable for ``probe_s`` (worth asking etcd about its lease)?"""
    return down_since is not None and now - down_since >= probe_s


def unrenewed_for(remaining: int, granted: int) -> float:
    """Seconds that have surely passed since a lease's last renewal (pure).

    Args:
        remaining: etcd's remaining TTL, whole seconds truncated (the lease has less than
            ``remaining + 1`` seconds left).
        granted: the lease's granted TTL.
    """
    return float(granted - remaining - 1)


def silent_peer(*, down_since: float | None, now: float, lease: tuple[int, int] | None,
                window: float, probe_s: float = PROBE_SILENT_S) -> tuple[bool, str]:
    """Is a peer host silent on both networks, so its world may be replaced now?

    Args:
        down_since: since when its data endpoint has not answered (None: it answers).
        now: the current time.
        lease: its lease's ``(remaining, granted)`` TTL from etcd, None when the lease is gone.
        window: ``silent_window(ttl)``: how long its lease must have gone unrenewed.
        probe_s: how long its data endpoint must have been silent.

    Returns:
        (silent, why).
    """
    if not suspect(down_since, now, probe_s):
        return False, "its data endpoint answers"
    assert down_since is not None
    quiet = f"its data endpoint silent for {now - down_since:.1f}s"
    if lease is None:
        return True, f"its lease is gone and {quiet}"
    passed = unrenewed_for(*lease)
    if passed < window:
        return False, f"its lease was renewed less than {passed + 1:g}s ago (window {window:g}s)"
    return True, f"its lease unrenewed for more than {passed:g}s (window {window:g}s) and {quiet}"


def on_silent_peer(*, in_round: bool, workers_running: bool, progress_at: float | None, now: float,
                   torchft: bool, stall_s: float = STALL_S) -> tuple[LossAction, str]:
    """A peer host went silent (``silent_peer``): what does this node do?

    Args:
        in_round: the peer is a participant of the job's current rendezvous round.
        workers_running: this node's workers of the current round are running.
        progress_at: when this node's workers last made progress (None: not seen yet).
        now: the current time.
        torchft: a torchft job (the replica groups' quorum goes on without it).
        stall_s: the stall that shows this node's workers wait on it.

    Returns:
        The action and why: restart this node's workers into a new round without it, only
        drop it from the rendezvous (mark), or wait (the workers still step: it takes part).
    """
    return on_node_loss(in_round=in_round, workers_running=workers_running, progress_at=progress_at, now=now,
                        stall_s=stall_s, torchft=torchft, lost="silent on both networks",
                        stepping="it takes part")

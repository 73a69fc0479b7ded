"""The lease file: how long a node's workers may still act for their world (a commit's fence).

``{run_dir}/lease.json`` (:func:`lease_path`) holds ``{"valid_until", "renewed_at", "ttl",
"window", "node"}``: the node's etcd lease was last renewed at ``renewed_at`` (the renewal
request's send time, Unix seconds); its workers may act for their world until
``valid_until = renewed_at + window``, where ``window = silent_window(ttl)`` (0.4 TTL).
Past that, peers that also cannot reach this node on the data network may declare it lost
(``marind.agent.liveness.silence``) and form a new world without it, well before the lease itself
expires (``renewed_at + ttl``): whatever its workers do then belongs to a replaced world.
Renewals come every ``renew_interval(ttl)`` (TTL/10), so a live node's window never runs
out between two of them. A renewal that follows a gap longer than the window does not
reopen it (``NodeRegistry.trusted_renewal``): the peers may be declaring the node lost at
that very moment; the next renewal, a TTL/10 later, does, unless the lease was revoked. The agent
(``marind.agent.liveness.fencing``) rewrites it atomically after each renewal; a checkpoint commit
asks :func:`commit_allowed` just before it writes its manifest, so a world that may have
been replaced never commits (an etcd outage longer than the TTL only postpones commits:
the saves fail until the lease is renewed again). A missing or malformed file allows
(a run without an agent: nothing to fence against).
"""

from __future__ import annotations

from pathlib import Path

from marind.core.jsonfile import read_json_object, write_json_atomic

#: a commit needs at least this much lease left (the manifest write must end inside it);
#: at most half the window (``commit_margin``)
COMMIT_MARGIN_S = 2.0
#: the share of the lease TTL after which a node whose lease went unrenewed and whose data
#: endpoint is silent may be declared lost by its peers (and its workers stop committing)
SILENT_FRACTION = 0.4
#: the share of the lease TTL between two renewals (keep-alives)
RENEW_FRACTION = 0.1


def silent_window(ttl: float) -> float:
    """Seconds without a renewal after which a node's world may be replaced (pure).

    Its peers may declare a node lost once its lease went unrenewed this long while its
    data endpoint is silent; its workers may commit only inside it (``valid_until``).
    """
    return SILENT_FRACTION * ttl


def renew_interval(ttl: float) -> float:
    """Seconds between two renewals of a node's lease (pure): TTL/10, at least 0.25 s."""
    return max(0.25, RENEW_FRACTION * ttl)


def lease_path(run_dir: str | Path) -> Path:
    """The lease file of a run: ``{run_dir}/lease.json``."""
    return Path(run_dir) / "lease.json"


def write_lease(run_dir: str | Path, *, renewed_at: float, ttl: float, node: str,
                until: float | None = None) -> None:
    """Atomically (re)write the run's lease file.

    Args:
        run_dir: the job's run directory on this node (it must exist).
        renewed_at: when the node's lease was last renewed (the request's send time).
        ttl: the lease's TTL in seconds.
        node: the node's name (informational).
        until: an earlier end (the node lost its data network then: ``marind.agent.liveness.data_watch``);
            ``valid_until`` is the earlier of it and ``renewed_at + window``, and ``fenced_at`` records it.

    Raises:
        OSError: the file could not be written.
    """
    window = silent_window(ttl)
    doc = {"valid_until": renewed_at + window, "renewed_at": renewed_at, "ttl": ttl, "window": window,
           "node": node}
    if until is not None:
        doc.update(valid_until=min(until, renewed_at + window), fenced_at=until)
    write_json_atomic(lease_path(run_dir), doc)


def read_lease_doc(run_dir: str | Path) -> dict | None:
    """The run's lease file as a JSON object, or None when it is missing or malformed."""
    return read_json_object(lease_path(run_dir))


def read_lease(run_dir: str | Path) -> float | None:
    """``valid_until`` of the run's lease file, or None when it is missing or malformed."""
    doc = read_lease_doc(run_dir)
    try:
        return None if doc is None else float(doc["valid_until"])
    except (KeyError, TypeError, ValueError):
        return None


def save_held(doc: dict | None, now: float) -> str | None:
    """Why a save due now should be skipped, from a lease file's contents; None: go ahead (pure).

    Two reasons, both of which would hold the save's commit (the commit fence) and could stall
    the step behind it (a due save first waits for the one before):

    * the agent has gone more than half the TTL without renewing the node's lease: renewals
      come every TTL/10, so etcd is out of this node's reach (its control network may be cut,
      and the storage with it);
    * the agent has fenced commits because this node reached none of its data-network peers
      (``fenced_at``, ``marind.agent.liveness.data_watch``): until a peer answers, or the peers prove
      dead rather than this node cut off, nothing may commit.

    Args:
        doc: the lease file's JSON object (:func:`read_lease_doc`); None or malformed: go ahead.
        now: the current Unix time.
    """
    if doc is None:
        return None
    if doc.get("fenced_at") is not None:
        return "commits are fenced: this node reaches none of its data-network peers"
    try:
        if now - float(doc["renewed_at"]) > float(doc["ttl"]) / 2:
            return "the node's lease is not being renewed: the control plane is out of reach"
    except (KeyError, TypeError, ValueError):
        pass
    return None


def commit_margin(ttl: float) -> float:
    """The lease a commit must leave: ``COMMIT_MARGIN_S``, at most half the window (pure)."""
    return min(COMMIT_MARGIN_S, silent_window(ttl) / 2)


def commit_allowed(valid_until: float | None, now: float, margin: float = COMMIT_MARGIN_S) -> tuple[bool, str]:
    """May this world commit a checkpoint now? (pure)

    Args:
        valid_until: the lease file's ``valid_until`` (None: no lease file).
        now: the current Unix time.
        margin: lease time the commit must leave.

    Returns:
        (allowed, why).
    """
    if valid_until is None:
        return True, "no lease file: not run by a marind agent"
    left = valid_until - now
    if left < margin:
        return False, (f"the node's lease may lapse before a commit ends ({left:.1f}s left of its last "
                       f"renewal + window, margin {margin:g}s): another world may have replaced this one")
    return True, f"lease valid for {left:.1f}s more"

"""Give up a cross-group collective whose peer replica group went silent (torchft mode).

A replica group whose host loses power, or is frozen, sends nothing: no FIN, no RST. The
survivors' gloo all-reduce would wait for it until ``fault.timeout`` and only then discard the
step. Their lighthouse knows sooner: every group's ManagerServer heartbeats to it (a thread of
its own, so a slow step never looks silent), and a group whose last heartbeat is older than
``fault.heartbeat_timeout`` is left out of the next quorum.

So while a cross-group collective is pending longer than ``POLL_S``, the waiting rank reads the
lighthouse's status page (``GET {lighthouse}/status``) once every ``POLL_S``: the latest quorum's
id and members, and each replica's heartbeat age; and from the wait's start it looks at the
lighthouse epoch (``lighthouse.json``, a local file) every ``EPOCH_SLICE_S``. When a member of
this rank's quorum has been silent longer than ``heartbeat_timeout`` (or the lighthouse epoch
moved: then without a read of the old lighthouse, whose host may be gone), :func:`decide_abort`
says abort: the step's error is reported to the Manager (``should_commit``
is then False on this group, as for a timed-out collective), and the collective is abandoned.
The next quorum forms without the silent group and the process group is reconfigured.

The other side: a group frozen before or during its collective and then resumed may complete it
at once against a survivor's held backend and would commit a step the survivors discarded (with
equal step counts later, nothing would heal the difference). So a step that ends longer than
``heartbeat_timeout`` after its quorum reads the lighthouse once more: a newer quorum means the
others went on without this group, and the step is not committed (:func:`decide_late`).

Abandoning, per backend: a gloo collective cannot be cut short (``abort`` blocks until the
collective's own timeout), so the waiting rank stops waiting, and the process group that holds
it (:class:`Abandoned`) is detached instead of aborted at the next reconfiguration, kept alive
until the stuck collective ends by itself; NCCL's process group is aborted (torchft's own way:
pending work fails at once).

Nothing here needs the agent: it works under plain torchrun with any lighthouse.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from marind.core.log import get_logger

POLL_S = 1.0               # a collective pending this long reads the lighthouse, then once per POLL_S
EPOCH_SLICE_S = 0.25       # meanwhile, how often it reads the lighthouse epoch (a local file)
STATUS_TIMEOUT_S = 1.0     # one status read; an unreadable lighthouse decides nothing
WAIT_SLICE_S = 0.05        # how often the waiting rank looks at its collective

_QUORUM_ID = re.compile(r"Previous quorum id:\s*(-?\d+)")
_MEMBER = re.compile(r"<b>([^<]+)</b>")
_HEARTBEAT = re.compile(r"^\s*([^\s<>]+): seen ([0-9.eE+-]+)s ago\s*$", re.MULTILINE)


class PeerSilent(RuntimeError):
    """A member of the quorum went silent during a collective: the step is discarded."""


@dataclass(frozen=True)
class LighthouseView:
    """What the lighthouse's status page says.

    Args:
        quorum_id: the id of its latest quorum, None before the first.
        members: that quorum's replica ids.
        heartbeats: replica id -> seconds since its last heartbeat.
    """

    quorum_id: int | None
    members: tuple[str, ...]
    heartbeats: Mapping[str, float] = field(default_factory=dict)


def parse_status(page: str) -> LighthouseView:
    """Parse torchft's lighthouse ``/status`` page (HTML: quorum, members, heartbeat ages).

    Args:
        page: the page's text.

    Returns:
        The view; empty fields where the page lacks them.
    """
    quorum_id: int | None = None
    members: tuple[str, ...] = ()
    head, sep, rest = page.partition("Previous quorum id:")
    if sep:
        m = _QUORUM_ID.search(sep + rest)
        quorum_id = int(m.group(1)) if m else None
        quorum_part = rest.split("<h2>Heartbeats</h2>", 1)[0]
        members = tuple(name.strip() for name in _MEMBER.findall(quorum_part))
    beats_part = page.split("<h2>Heartbeats</h2>", 1)[1] if "<h2>Heartbeats</h2>" in page else ""
    heartbeats = {name: float(age) for name, age in _HEARTBEAT.findall(beats_part)}
    return LighthouseView(quorum_id, members, heartbeats)


@dataclass(frozen=True)
class AbortDecision:
    """Whether to give up the pending collective, and why (for the log)."""

    abort: bool
    reason: str


def decide_abort(members: tuple[str, ...] | None, heartbeats: Mapping[str, float] | None, *,
                 heartbeat_timeout: float, epoch: int, epoch_now: int) -> AbortDecision:
    """Decide whether a pending cross-group collective waits on a silent peer.

    Args:
        members: the replica ids of this rank's quorum; None when not known (the lighthouse's
            latest quorum is not this rank's, or its page was unreadable).
        heartbeats: replica id -> heartbeat age (s) as the lighthouse sees it; None when unreadable.
        heartbeat_timeout: ``fault.heartbeat_timeout``: the lighthouse drops a group silent this long.
        epoch: the lighthouse epoch this rank's Manager was built on.
        epoch_now: the epoch in ``lighthouse.json`` now (-1: none known).

    Returns:
        The decision and its reason. Abort when the lighthouse moved (its old quorum is gone),
        or when a member's heartbeat is older than ``heartbeat_timeout``; a member the page does
        not list, an unreadable page and an unknown quorum decide nothing (the collective's own
        timeout still bounds the wait).
    """
    if epoch_now not in (epoch, -1):
        return AbortDecision(True, f"lighthouse moved (epoch {epoch} -> {epoch_now})")
    if heartbeats is None:
        return AbortDecision(False, "lighthouse status unreadable")
    if members is None:
        return AbortDecision(False, "this rank's quorum is not the lighthouse's latest")
    silent = sorted((heartbeats[m], m) for m in members if m in heartbeats and heartbeats[m] > heartbeat_timeout)
    if silent:
        age, name = silent[-1]
        return AbortDecision(True, f"replica {name} silent for {age:.1f}s (> heartbeat_timeout {heartbeat_timeout:g}s)")
    return AbortDecision(False, "every member heartbeats")


def decide_late(latest_quorum: int | None, quorum_id: int, pending_s: float, heartbeat_timeout: float,
                silent: str | None = None) -> AbortDecision:
    """Decide whether a step whose collective did complete, but late, must still not be committed.

    A group frozen before or in the middle of a collective (its host stopped, then resumed) can complete it
    against the held backend of peers that gave it up long ago: it would commit a step they
    discarded, and if they have committed just as many steps since, nothing heals the difference.
    Peers can form a newer quorum only without a member that is in this collective, so a newer
    quorum at the lighthouse means the others went on without this rank's group.

    Args:
        latest_quorum: the lighthouse's latest quorum id; None when unknown (decides nothing).
        quorum_id: this rank's quorum id.
        pending_s: how long the step took, from its quorum to the collective's end.
        heartbeat_timeout: ``fault.heartbeat_timeout``: only a step longer than this is checked.
        silent: another member of this quorum that the lighthouse has not heard from for longer than
            ``heartbeat_timeout`` (None: none). A lighthouse frozen with this group (the same host
            powered off and back) shows no newer quorum, but its peers' heartbeats stopped: they went
            on elsewhere, on a lighthouse elected meanwhile.

    Returns:
        Abort (do not commit) when a newer quorum formed while the collective was pending, or when
        another member went silent at the lighthouse.
    """
    if pending_s > heartbeat_timeout and silent is not None:
        return AbortDecision(True, f"replica {silent} silent at this lighthouse after this group's {pending_s:.1f}s "
                                   f"step (quorum {quorum_id}): the others went on elsewhere")
    if pending_s <= heartbeat_timeout or latest_quorum is None or latest_quorum <= quorum_id:
        return AbortDecision(False, "completed")
    return AbortDecision(True, f"quorum {latest_quorum} formed without this group during its {pending_s:.1f}s step "
                               f"(quorum {quorum_id})")


def read_status(address: str, timeout: float = STATUS_TIMEOUT_S) -> LighthouseView | None:
    """GET ``{address}/status`` and parse it; None when the lighthouse does not answer in time."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as resp:
            return parse_status(resp.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


class SilentPeerWatch:
    """Waits on one rank's cross-group collectives, giving up when a quorum member goes silent.

    Args:
        address: the lighthouse address the Manager was built with (``http://host:port``).
        heartbeat_timeout: ``fault.heartbeat_timeout`` (seconds).
        epoch: the lighthouse epoch the Manager was built on.
        epoch_now: reads the current epoch (``LighthouseSource.epoch``).
        quorum_id: reads the Manager's quorum id.
        read: reads the lighthouse (``read_status``; a test passes its own).
        clock: monotonic seconds (a test passes its own).
        own: this group's replica id prefix (``{job}_rg{group}:``): its own heartbeat is not a peer's.
    """

    def __init__(self, address: str, heartbeat_timeout: float, epoch: int, epoch_now: Callable[[], int],
                 quorum_id: Callable[[], int], read: Callable[[str], LighthouseView | None] = read_status,
                 clock: Callable[[], float] = time.monotonic, own: str = "\0") -> None:
        self.address, self.heartbeat_timeout, self.epoch, self.own = address, heartbeat_timeout, epoch, own
        self.epoch_now, self.quorum_id, self.read, self.clock = epoch_now, quorum_id, read, clock
        self.members: dict[int, tuple[str, ...]] = {}   # quorum id -> members, as last seen
        self.aborts = 0

    def moved(self) -> bool:
        """Has the lighthouse epoch moved away from this Manager's (a local file read, no request)?"""
        return self.epoch_now() not in (self.epoch, -1)

    def check(self) -> AbortDecision:
        """Read the lighthouse once and decide (see :func:`decide_abort`); no read once it moved."""
        epoch_now = self.epoch_now()
        if epoch_now not in (self.epoch, -1):      # the old lighthouse may be gone: a read would wait out its timeout
            return decide_abort(None, None, heartbeat_timeout=self.heartbeat_timeout, epoch=self.epoch,
                                epoch_now=epoch_now)
        view = self.read(self.address)
        qid = self.quorum_id()
        if view is not None and view.quorum_id is not None and view.members:
            self.members[view.quorum_id] = view.members
            for old in [q for q in self.members if q < view.quorum_id - 1]:
                del self.members[old]
        return decide_abort(self.members.get(qid), view.heartbeats if view is not None else None,
                            heartbeat_timeout=self.heartbeat_timeout, epoch=self.epoch, epoch_now=self.epoch_now())

    def wait(self, wait_done: Callable[[float], bool], poll_s: float = POLL_S,
             since: float | None = None, slice_s: float = EPOCH_SLICE_S) -> AbortDecision:
        """Wait until the collective ends, or :meth:`check` says abort.

        Args:
            wait_done: waits up to the given seconds for the collective; True once it ended
                (successfully or not).
            poll_s: pending this long before the first lighthouse read, and between reads.
            since: when this step's quorum formed (``clock`` seconds); a step that ends longer
                than ``heartbeat_timeout`` after it (slow, or frozen before or during the
                collective) is checked once more with :func:`decide_late`. None: the wait's start.
            slice_s: how often the lighthouse epoch is looked at in between (a moved lighthouse
                ends the wait at once, without a read of the old one, which may be gone).

        Returns:
            ``abort=False`` when the collective ended in time, else the abort decision.
        """
        started, noted = self.clock(), False
        next_read = started + poll_s
        while not wait_done(min(slice_s, poll_s)):
            if self.clock() < next_read and not self.moved():
                continue
            decision = self.check()
            next_read = self.clock() + poll_s
            pending = round(self.clock() - started, 2)
            if decision.abort:
                self.aborts += 1
                get_logger("trainer").warning("ft_collective_abandoned", reason=decision.reason, pending_s=pending)
                return decision
            if not noted and pending > self.heartbeat_timeout:
                noted = True     # once per collective: why a long wait goes on
                get_logger("trainer").info("ft_collective_pending", reason=decision.reason, pending_s=pending)
        pending = self.clock() - (started if since is None else min(since, started))
        if pending <= self.heartbeat_timeout:
            return AbortDecision(False, "completed")
        view = self.read(self.address)
        qid = self.quorum_id()
        silent = None
        if view is not None:
            members = self.members.get(qid) or (view.members if view.quorum_id == qid else ())
            ages = {m: view.heartbeats[m] for m in members if m in view.heartbeats and not m.startswith(self.own)}
            silent = max(ages, key=lambda m: ages[m]) if ages and max(ages.values()) > self.heartbeat_timeout else None
        late = decide_late(view.quorum_id if view is not None else None, qid, pending, self.heartbeat_timeout,
                           silent)
        if late.abort:
            self.aborts += 1
            get_logger("trainer").warning("ft_collective_abandoned", reason=late.reason, pending_s=round(pending, 2))
        return late


class Abandoned:
    """Process groups whose collective was abandoned, kept alive until that collective ends.

    A gloo backend with a pending collective blocks whoever aborts or destroys it until the
    collective's own timeout; holding it here lets the reconfiguration go on at once. What is
    held is released only once its collective ended (by a later ``hold`` or ``len``), never
    while it is pending: not even when the trainer is done with its Manager.
    """

    def __init__(self) -> None:
        self._held: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def hold(self, backend: Any, work: Any) -> None:
        """Keep ``backend`` alive while ``work`` (its stuck collective) is not completed."""
        with self._lock:
            self._held = [(b, w) for b, w in self._held if not _completed(w)]
            self._held.append((backend, work))
            _HELD.append(self)

    def __len__(self) -> int:
        with self._lock:
            self._held = [(b, w) for b, w in self._held if not _completed(w)]
            return len(self._held)


_HELD: list[Abandoned] = []     # module-lifetime references: a held backend outlives its FTGroup


def wait_slice(work: Any) -> Callable[[float], bool]:
    """A ``wait_done`` for :meth:`SilentPeerWatch.wait` over a c10d ``Work``.

    ``Work.wait(timeout)`` blocks (GIL released) up to the timeout and raises when the work is not
    done by then, leaving it pending; no Python callback is attached to the work, so one that
    ends after it was abandoned (even while the interpreter exits) calls into nothing.
    """
    def wait_done(seconds: float) -> bool:
        try:
            work.wait(timedelta(seconds=seconds))
        except RuntimeError:
            pass          # not done in time, or failed: is_completed tells which
        return _completed(work)
    return wait_done


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot say is treated as done
        return True

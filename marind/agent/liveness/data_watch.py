"""Acting on a dead data network: a node whose lease lives on but whose peers' workers cannot reach it.

The agent keeps one ``DataNetwork`` (its ``DataProber``: listener and probes,
``marind.agent.liveness.data_probe``) and, in it, one ``DataWatch`` per run (by job: the
watch's own state, apart from the ``RunMonitor``). Each tick, for each run:

1. the watch probes the data endpoints that the job's other nodes publish in
   their rows (``reach_rows``: ``{p}/jobs/{job}/reach/{node}``, kept from a watch);
2. a run that has reached none of its peers for ``COMMIT_FENCE_S`` fences its
   commits at once: its ``lease.json`` ends at the isolation's start
   (``marind.core.lease_file``), so no checkpoint of a world that may be
   replaced gets committed; the fence lifts when a peer answers again, or
   when every other node of the job proves dead (silent on etcd too, below):
   no live node is left to replace this node's world;
3. the node publishes its own row (``publish``: put when it changed): its
   endpoint, its link's carrier, the peers it probes and since when each is
   silent. The fence of step 2 is written before a row that shows the
   isolation is;
4. every node judges the rows alike (``data_decisions.cut_off``) and acts
   (``data_decisions.on_data_loss``): a survivor marks the cut-off node's
   torchrun lost for the rendezvous (``rdzv/lost/{desc}``) and, when its workers
   stalled, SIGKILLs them (every such survivor, ``marind.agent.node_losses``), and
   the agent whose claim of ``departed/{node}/{incarnation}`` wins writes
   ``node_lost`` (cause ``data_network_gone``): a new round without it, no ``hang_timeout`` (torchft: no kill; the replica groups'
   quorum goes on without it); the ``RunMonitor`` is told (``note_member_lost``) so
   that it does not act on the loss again. The cut-off node fences its run (the
   agent's ``fence``, ``Fencing.fence_replaced``: everything SIGKILLed, queued writes dropped, a new
   registration, ``host_fenced``) and **holds** the job: it starts it again
   (``node_rejoined``) only once a peer's data endpoint answers again, every probe
   for a lease TTL (cut off for a broken pair, ``data_decisions.must_answer``: once
   every peer it could not reach does so, or has left the cluster). A torchft
   node fences even while its group steps (alone it would train a world of its
   own) and gives up its replica-group slot and, if it holds it, the lighthouse,
   so the connected nodes elect one they reach.

Before the rows are judged, a peer whose data endpoint went silent is checked
against its lease (``marind.agent.liveness.silence``): silent on both networks (its
lease unrenewed past the silent window of its TTL) while this node's workers
of its round stalled, it is lost now, before its lease expires. This node
revokes its lease (first: it can never renew into its old world), marks its
torchrun lost, claims the loss and SIGKILLs its workers (``node_lost``, cause
``host_silent``). Without stalled workers here nothing is done early, but for
a torchft job whose lighthouse the silent node holds: its key is deleted
(same epoch only) so that the connected nodes elect one at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marind.agent.decisions import LossAction
from marind.agent.liveness.data_decisions import (
    DATA_NETWORK_GONE,
    DataAction,
    ProbeRing,
    ReachRow,
    commit_fence_due,
    cut_off,
    must_answer,
    on_data_loss,
)
from marind.agent.liveness.data_probe import DataProber, Endpoint, link_up
from marind.agent.liveness.reach_rows import ReachRows
from marind.agent.liveness.silence import HOST_SILENT, on_silent_peer, silent_peer, stall_for, suspect
from marind.agent.membership import Loss
from marind.core.errors import ControlPlaneUnavailable
from marind.core.lease_file import silent_window, write_lease
from marind.core.log import get_logger

if TYPE_CHECKING:
    from marind.agent.outbox import Outbox
    from marind.agent.registry import NodeRegistry
    from marind.agent.run_monitor import RunMonitor


class DataWatch:
    """One run's view of its peers' data endpoints and what it did about them.

    Args:
        run: the run.
        prober: the agent's prober.
        reach: the job's rows (this node's put, everyone's kept).
    """

    def __init__(self, run: RunMonitor, prober: DataProber, reach: ReachRows):
        self.run, self.prober, self.reach = run, prober, reach
        self.acted: set[tuple[str, str]] = set()    # (node, incarnation) acted on
        self.commit_fence_at: float | None = None
        self.dead: frozenset[str] = frozenset()     # peers silent on both networks (``silence.silent_peer``)
        self.ring = ProbeRing(run.job, run.node)

    def peers(self) -> dict[str, Endpoint]:
        """The data endpoints this node probes (``data_decisions.probe_targets`` among the job's other
        nodes as last polled, less the ones acted on)."""
        out = self.endpoints()
        targets = self.ring.targets(frozenset(out))
        return {node: ep for node, ep in out.items() if node in targets}

    def endpoints(self) -> dict[str, Endpoint]:
        """Every other node's data endpoint as last read, less the ones acted on."""
        members = self.run.members
        if members is None:
            return {}
        out = {}
        for node, data in self.reach.rows.items():
            if node == self.run.node or node not in members.known or (node, str(members.known[node])) in self.acted:
                continue
            try:
                token = data.get("token")
                out[node] = (str(data["addr"]), int(data["port"]), None if token is None else str(token))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def refresh(self) -> tuple[dict[str, float], frozenset[str]]:
        """Probe the current peers; (peer -> not answering steadily since, the peers probed so far).

        ``flaky_since``, not ``down_since``: a peer behind a lossy link, whose probes fail and answer
        by turns, counts as down until it answers steadily again (``data_probe.STEADY_S``).
        """
        peers = self.peers()
        self.prober.want(self.run.job, peers)
        states = self.prober.states(self.run.job)
        return ({p: s.flaky_since for p, s in states.items() if s.flaky_since is not None},
                frozenset(states))

    def update_fence(self, now: float, registry: NodeRegistry) -> None:
        """Set or lift the commit fence and rewrite ``lease.json`` when it changes."""
        down, probed = self.refresh()
        fence_at = commit_fence_due(down, probed, now, dead=self.dead, others=frozenset(self.endpoints()))
        if (fence_at is None) == (self.commit_fence_at is None):
            return
        self.commit_fence_at = fence_at
        get_logger(__name__, node=self.run.node).warning(
            "data_commit_fence", job=self.run.job, fenced=fence_at is not None, down=sorted(down),
            dead=sorted(self.dead))
        try:
            write_lease(self.run.run_dir, renewed_at=registry.trusted_renewal, ttl=registry.ttl,
                        node=self.run.node, until=fence_at)
        except OSError:
            pass

    def row(self, now: float) -> dict:
        """This node's row: endpoint, carrier, probes."""
        down, probed = self.refresh()
        return {**self.prober.endpoint(), "at": now, "probed": sorted(probed), "down": down}

    def publish(self, now: float, lease: object) -> bool:
        """Put this node's row where it changed (``ReachRows.publish``; raises ControlPlaneUnavailable)."""
        return self.reach.publish(self.row(now), lease)

    def rows(self, now: float) -> dict[str, ReachRow]:
        """Every node's row: the others' as last read (each as of now: its key lives under its
        node's lease), this node's as of now."""
        members = self.run.members
        if members is None:
            return {}
        rows = {}
        for node, data in self.reach.rows.items():      # a row of a node not in the job (left) has no say
            row = ReachRow.from_data(node, data, at=now)
            if row is not None and node != self.run.node and node in members.known \
                    and (node, str(members.known[node])) not in self.acted:
                rows[node] = row
        me = ReachRow.from_data(self.run.node, self.row(now))
        if me is not None:
            rows[self.run.node] = me
        return rows


@dataclass(frozen=True)
class Hold:
    """A job this node fenced because its data network was gone: not started until a peer answers
    (``must``: until each of those answers, or has left the cluster)."""

    since: float
    peers: tuple[str, ...]
    must: tuple[str, ...] = ()


class DataNetwork:
    """The agent's data-network watch over all its runs.

    Args:
        node: this node's name.
        outbox: the agent's outbox (events).
        registry: this node's registration (lease times for ``lease.json``).
        fresh_s: rows published longer ago are ignored (a row read from etcd is as of now: its key
            goes with its node's lease).
        steady_s: a held job starts again once a peer answered every probe for this long
            (default ``fresh_s``, the lease TTL: a lossy link, answering by turns, does not let it flap back).
    """

    def __init__(self, node: str, outbox: Outbox, registry: NodeRegistry, *, fresh_s: float,
                 steady_s: float | None = None):
        self.node, self.outbox, self.registry, self.fresh_s = node, outbox, registry, fresh_s
        self.steady_s = fresh_s if steady_s is None else steady_s
        self.prober = DataProber().start()
        self.holds: dict[str, Hold] = {}
        self.watches: dict[str, DataWatch] = {}     # job -> the watch of the run of it now
        self.log = get_logger(__name__, node=node)

    def attach(self, run: RunMonitor) -> DataWatch | None:
        """Watch ``run``'s peers (elastic and torchft runs; a watch of an earlier run of its job goes)."""
        self._forget(run.job)
        if run.members is None:
            return None
        reach = ReachRows(run.members.client, run.job, run.node)
        watch = self.watches[run.job] = DataWatch(run, self.prober, reach)
        return watch

    def _forget(self, job: str) -> None:
        """Drop ``job``'s watch and this node's row of it."""
        watch = self.watches.pop(job, None)
        if watch is not None:
            watch.reach.close()

    def watch_of(self, run: RunMonitor) -> DataWatch | None:
        """``run``'s watch (None before ``tick`` attached one, or without a membership watch)."""
        watch = self.watches.get(run.job)
        return watch if watch is not None and watch.run is run else None

    def commit_fence_at(self, run: RunMonitor) -> float | None:
        """Where ``run``'s commits are fenced (its ``lease.json`` ends there); None: they are not."""
        watch = self.watch_of(run)
        return watch.commit_fence_at if watch is not None else None

    def may_start(self, job: str, runs: dict[str, RunMonitor]) -> bool:
        """False while ``job`` is held: fenced for a dead data network that no peer answers on yet."""
        self.prune(runs)
        hold = self.holds.get(job)
        if hold is None:
            return True
        states, now = self.prober.states(f"hold:{job}"), time.time()
        steady = {p: s for p, s in states.items()     # answering every probe for a lease TTL
                  if s.up_since is not None and s.steady_for(now) >= self.steady_s}
        if hold.must:       # a broken pair: the peers it could not reach must answer (or be gone); the others
            back = sorted(steady) if all(p in steady or not self._registered(p) for p in hold.must) else []
        else:               # it reached nobody: only answers that began after the hold show its network back
            back = sorted(p for p, s in steady.items() if s.up_since is not None and s.up_since > hold.since)
        if (back or not hold.peers) and link_up(self.prober.addr):
            self.log.info("data_network_back", job=job, reached=back, held_s=round(time.time() - hold.since, 1))
            del self.holds[job]
            self.prober.drop(f"hold:{job}")
            return True
        return False

    def _registered(self, node: str) -> bool:
        """Is ``node`` registered (its lease alive)? True when etcd cannot tell now."""
        client = self.registry.client
        try:
            return client.get(client.key("nodes", node))[0] is not None
        except ControlPlaneUnavailable:
            return True

    def prune(self, runs: dict[str, RunMonitor]) -> None:
        """Stop probing for jobs no longer run here (held ones go on), and forget their watches."""
        for job in self.prober.jobs():
            if not job.startswith("hold:") and job not in runs:
                self.prober.drop(job)
        for job in [j for j in self.watches if j not in runs]:
            self._forget(job)

    def tick(self, run: RunMonitor, now: float, *, stall_s: float, fence: Callable[[RunMonitor, str, float], None],
             runs: dict[str, RunMonitor], online: bool) -> None:
        """The commit fence, the verdict and this node's action for one run (raises ControlPlaneUnavailable).

        Args:
            run: the run.
            now: the current time.
            stall_s: the stall that counts as stuck.
            fence: fences a run whose world was replaced (``Fencing.fence_replaced``: this node cut off).
            runs: the agent's runs (a fenced one is removed).
            online: etcd is reachable (otherwise only the commit fence is kept).
        """
        self.prune(runs)
        watch = self.watch_of(run) or self.attach(run)
        members = run.members
        if watch is None or members is None:
            return
        if not online:
            watch.dead = frozenset()    # "dead" rests on etcd's word, which this node cannot hear now
        else:
            watch.reach.refresh()
        watch.update_fence(now, self.registry)
        if not online:
            return
        watch.publish(now, self.registry.lease)     # after the fence: a row that shows an isolation follows it
        dead = watch.dead
        self._silent_hosts(run, watch, now)
        if watch.dead != dead:
            watch.update_fence(now, self.registry)  # a peer found dead is no sign of this node's isolation
        rows = watch.rows(now)
        cut, verdict = cut_off(rows, now=now, window=stall_s, fresh_s=self.fresh_s)
        if not cut:
            return
        in_round = frozenset(n for n in cut if n == run.node or members.in_current_round(
            self._loss(run, n), members.rdzv_desc(self._loss(run, n))))
        action, nodes, why = on_data_loss(me=run.node, cut=cut, acted=frozenset(n for n, _ in watch.acted),
                                          in_round=in_round, workers_running=run.has_workers(),
                                          progress_at=run.progress_at, now=now, stall_s=stall_s,
                                          torchft=run.ft is not None)
        if action == DataAction.FENCE:
            peers = {p: ep for p, ep in watch.endpoints().items() if p not in cut}   # every one, not the ring
            must = must_answer(rows.get(run.node), frozenset(peers))
            self.holds[run.job] = Hold(since=now, peers=tuple(sorted(peers)), must=tuple(sorted(must)))
            self.prober.want(f"hold:{run.job}", peers)
            self.prober.drop(run.job)
            fence(run, f"{why} ({verdict})", now)
            if run.ft is not None:      # etcd is reachable: the lighthouse moves now, not when the old lease expires
                run.ft.stop(release=True)
            runs.pop(run.job, None)
        elif action in (DataAction.RESTART, DataAction.MARK):
            for node in sorted(nodes):
                self._act(run, watch, node, action, f"{why} ({verdict})", rows.get(node))

    @staticmethod
    def _loss(run: RunMonitor, node: str, cause: str = DATA_NETWORK_GONE) -> Loss:
        """The loss of ``node`` with its record as it is now (one read: the membership's view holds
        each record as it was created, and a retried run rewrites its torchrun and workers)."""
        members = run.members
        assert members is not None
        record = members.client.get_json(members.prefix + node)
        if not isinstance(record, dict):
            record = members.records.get(node, {})
        return Loss(node, str(members.known.get(node, "?")), cause, record)

    def _silent_hosts(self, run: RunMonitor, watch: DataWatch, now: float) -> None:
        """Act on each peer silent on both networks (``silence.silent_peer``); raises ControlPlaneUnavailable."""
        members = run.members
        assert members is not None
        states = self.prober.states(run.job)
        client = members.client
        dead: set[str] = set()
        for node in sorted(watch.peers()):
            state = states.get(node)
            down_since = state.down_since if state is not None else None
            if not suspect(down_since, now):
                continue        # it answers again (a frozen host resumed inside its lease): alive
            lease_id = client.lease_of(client.key("nodes", node))
            lease = client.lease_time_to_live(lease_id) if lease_id is not None else None
            # the window of ITS lease (agents may differ in lease_ttl): the one its commits honour
            window = silent_window(lease[1] if lease is not None else self.registry.ttl)
            silent, why = silent_peer(down_since=down_since, now=now, lease=lease, window=window)
            if not silent:
                continue
            dead.add(node)
            if run.ft is not None:
                run.ft.drop_silent_holder(node)     # torchft: the lighthouse moves now; the loss waits for the lease
            else:
                self._act_silent(run, watch, node, lease_id, why, now)
        watch.dead = frozenset(dead)

    def _act_silent(self, run: RunMonitor, watch: DataWatch, node: str, lease_id: int | None, why: str,
                    now: float) -> None:
        members = run.members
        assert members is not None
        loss = self._loss(run, node, HOST_SILENT)
        desc = members.rdzv_desc(loss)
        action, what = on_silent_peer(in_round=members.in_current_round(loss, desc),
                                      workers_running=run.has_workers(), progress_at=run.progress_at,
                                      now=now, torchft=run.ft is not None, stall_s=stall_for(run.progress_interval))
        if action != LossAction.RESTART:
            return      # no workers of this node wait on it: no evidence its own stopped; its lease decides
        revoked = lease_id is not None and members.client.revoke_lease_id(lease_id)
        self._declare(run, watch, loss, desc, action.value, f"{why}; {what}", restart=True,
                      log={"revoked": revoked})

    def _act(self, run: RunMonitor, watch: DataWatch, node: str, action: DataAction, why: str,
             row: ReachRow | None) -> None:
        members = run.members
        assert members is not None
        loss = self._loss(run, node)
        self._declare(run, watch, loss, members.rdzv_desc(loss), action.value, why,
                      restart=action == DataAction.RESTART, event={"link_up": row.link_up if row is not None else None})

    def _declare(self, run: RunMonitor, watch: DataWatch, loss: Loss, desc: str | None, action: str, reason: str,
                 *, restart: bool, log: dict | None = None, event: dict | None = None) -> None:
        """Mark ``loss``'s torchrun lost for the rendezvous, SIGKILL this node's workers when ``restart`` and
        claim the loss; the agent whose claim wins writes ``node_lost`` (with ``event``'s fields). The run
        is told (``RunMonitor.note_member_lost``): it does not act on the loss again."""
        members = run.members
        assert members is not None
        members.mark_lost(loss, desc)
        first = members.claim(loss, {"action": action})
        watch.acted.add((loss.node, loss.incarnation))
        run.note_member_lost(loss)
        killed = run.kill_workers() if restart else []     # every stalled survivor (``node_losses``: SIGTERM waits)
        self.log.warning("node_lost", job=run.job, lost=loss.node, cause=loss.cause, action=action, reason=reason,
                         recorded=first, rdzv_node=desc, killed=killed, **(log or {}))
        if not first:
            return
        self.outbox.event(run.job, "node_lost", {"node": loss.node, "cause": loss.cause, "action": action,
                                                 "reason": reason, "killed": killed, **(event or {})})

    def stop(self) -> None:
        """Stop the prober."""
        self.prober.stop()

"""The client library behind `marind submit/status/events/cancel/logs/nodes/rm`.

A thin layer over ``EtcdClient`` and ``marind.control.job_records``; the CLI only
parses arguments and prints. ``status_document`` is the ``--json``
schema of docs/design.md §5.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from marind.control import job_records as J
from marind.control.auth_roles import owned_job_id
from marind.control.change_watch import ChangeWatch
from marind.control.config import client_settings, resolve_endpoint
from marind.control.events import JOB_REFUSED, append_event, list_events
from marind.control.ft_status import ft_status, is_torchft
from marind.control.job_history import start_ledger
from marind.control.lifecycle import JobEvent, JobState
from marind.control.nodes import live_nodes
from marind.core.errors import NotFound, PermissionDenied
from marind.core.etcd_client import EtcdClient

SCHEMA_VERSION = 1
#: States whose status row shows a reason (the last worker error line, else the state's reason).
REASON_STATES = ("RESTARTING", "FAILED")
#: Event kinds that end a job's event stream.
FINAL_EVENTS = ("succeeded", "failed", "cancelled", JOB_REFUSED)


def connect(etcd: str | None = None, config_file: str | None = None, state_dir: str | None = None) -> EtcdClient:
    """A client on the control plane found in the documented order; pings it (exit 3 if down).

    Args:
        etcd: ``--etcd``.
        config_file: ``--config``.
        state_dir: ``--state-dir``: the local agent's state dir, searched for its ``etcd.endpoint``
            before ``MARIND_STATE_DIR`` and the default state dirs.

    Returns:
        The client.
    """
    env = dict(os.environ, MARIND_STATE_DIR=state_dir) if state_dir else None
    endpoints, _ = resolve_endpoint(etcd, config_file, env=env)
    client = EtcdClient(endpoints, **client_settings(config_file))
    client.ping()
    return client


def row_reason(state: str, state_reason: str, last_error: dict | None, checkpoint_error: str | None = None,
               node_issue: str | None = None) -> str:
    """A job's reason as `status` shows it.

    Args:
        state: the job's state.
        state_reason: the reason its state record carries.
        last_error: ``{p}/jobs/{job}/last_error`` (the last worker error line), or None.
        checkpoint_error: the job's progress's ``checkpoint_error`` (why its latest save failed), or None.
        node_issue: what is wrong with a node the job runs on (``node_issues``: a full state dir), or None.

    Returns:
        For RESTARTING and FAILED, the last worker error line when one was recorded; else the
        state's reason; for RUNNING and SUCCEEDED, why the latest checkpoint save failed while
        no later one committed; for RUNNING, else, what is wrong with one of its nodes.
    """
    if state in REASON_STATES and isinstance(last_error, dict) and last_error.get("line"):
        return str(last_error["line"])
    if state in ("RUNNING", "SUCCEEDED") and checkpoint_error:
        return checkpoint_error
    if state == "RUNNING" and node_issue:
        return node_issue
    return state_reason


def node_issues(nodes: dict[str, dict]) -> dict[str, str]:
    """What is wrong with each registered node that says so, by name: ``node n1: state dir ... is full ...``
    (the node record's ``state_dir_full``, written by its agent while its state dir is full)."""
    out = {}
    for name, rec in sorted(nodes.items()):
        full = rec.get("state_dir_full")
        if isinstance(full, dict):
            out[name] = f"node {name}: {full.get('reason') or 'state dir full'}"
    return out


class JobsClient:
    """The jobs on one control plane, as the CLI sees them.

    Args:
        client: the etcd client (``connect``).
    """

    def __init__(self, client: EtcdClient, owner: str | None = None):
        self.client = client
        self.owner = owner          # the etcd user: its job ids start with ``owner.`` (control/auth_roles.py)

    def submit(self, spec_dict: dict, name: str, job_id: str | None = None, sign_key: str | None = None) -> str:
        """Create a PENDING job.

        Args:
            spec_dict: the validated spec (``RunSpec.to_dict()``).
            name: ``job.name``, the stem of a generated id.
            job_id: an id of the user's choosing instead (``owner.`` is put before it when missing).
            sign_key: an Ed25519 private key file: the spec is signed with it (``job_signing``).

        Returns:
            The job's id.

        Raises:
            ValueError: a bad ``job_id``, or a job with that id exists.
            PermissionDenied: etcd's roles do not let this user create the job.
        """
        job = owned_job_id(self.owner, J.check_job_id(job_id) if job_id else J.new_job_id(name))
        J.check_job_id(job)
        signature = None
        if sign_key:
            from marind.control.job_signing import load_private_key, sign  # cryptography: only when signing
            signature = sign(job, spec_dict, load_private_key(sign_key))
        try:
            created = J.create_job(self.client, job, spec_dict, signature=signature)
        except PermissionDenied as exc:
            raise PermissionDenied(f"etcd user {self.owner or '(none)'} may not create job {job}: a submitter "
                                   f"writes only ids starting '{self.owner or 'USER'}.' (docs/design.md §2, etcd roles); "
                                   f"{exc}") from exc
        if not created:
            raise ValueError(f"job {job} already exists: pick another --id or `marind rm {job}`")
        start_ledger(self.client, job)      # the goodput ledger counts from here (waiting for nodes)
        return job

    def job(self, job: str) -> dict:
        """One job's status row (``NotFound`` when there is no such job)."""
        return self._job_row(J.read_job(self.client, job), node_issues(live_nodes(self.client)))

    def jobs(self) -> list[dict]:
        """Every job's status row, in submission order."""
        rows = []
        issues = node_issues(live_nodes(self.client))
        for job in J.list_job_ids(self.client):
            try:
                rows.append(self._job_row(J.read_job(self.client, job), issues))
            except NotFound:
                continue
        return sorted(rows, key=lambda r: r["submitted_rev"])

    def _job_row(self, view: J.JobView, issues: dict[str, str]) -> dict:
        nodes = J.job_nodes(self.client, view.id)
        progress = self.client.get_json(self.client.key("jobs", view.id, "progress")) or {}
        nproc = view.nproc_per_node
        world = progress.get("world_size") if progress else None
        if not world and nodes:
            world = sum(len(n.get("workers", [])) for n in nodes.values()) or len(nodes) * nproc
        last_error = self.client.get_json(self.client.key("jobs", view.id, "last_error"))
        state = view.state.state.value
        return {"id": view.id, "name": view.name,
                "state": state, "reason": row_reason(state, view.state.reason, last_error,
                                                     progress.get("checkpoint_error"),
                                                     next((issues[n] for n in sorted(nodes) if n in issues), None)),
                "last_error": last_error,
                "nodes": sorted(nodes), "world_size": world or 0,
                "step": _last_step(progress.get("step"), view.state.step), "loss": progress.get("loss"),
                "tokens_per_s": progress.get("tokens_per_s"),
                "last_checkpoint_step": progress.get("last_checkpoint_step"),
                "restarts": view.state.restarts,
                "updated_at": max(view.state.updated_at, float(progress.get("updated_at") or 0)),
                "submitted_rev": view.submitted_rev,
                "target_steps": view.target_steps,
                "torchft": ft_status(self.client, view.id, nodes)
                if is_torchft(view.run_spec or view.spec) else None,
                "stragglers": (self.client.get_json(self.client.key("jobs", view.id, "stragglers")) or {}).get("ranks")
                or []}

    def nodes(self) -> list[dict]:
        """The registered nodes' records, by name."""
        return [dict(v, node=k) for k, v in sorted(live_nodes(self.client).items())]

    def status_document(self, job: str | None = None) -> dict:
        """`marind status --json`: schema version, nodes, and the jobs (or ``job``) (docs/design.md §5)."""
        jobs = [self.job(job)] if job else self.jobs()
        keys = ("id", "name", "state", "nodes", "world_size", "step", "loss", "tokens_per_s",
                "last_checkpoint_step", "restarts", "reason", "updated_at")
        return {"schema_version": SCHEMA_VERSION, "nodes": self.nodes(),
                "jobs": [{k: j[k] for k in keys} | ({"torchft": j["torchft"]} if j["torchft"] else {})
                         | ({"stragglers": j["stragglers"]} if j["stragglers"] else {})
                         | ({"last_error": j["last_error"]} if j["last_error"] else {}) for j in jobs]}

    def cancel(self, job: str, by: str) -> str:
        """Ask the agents to stop a job and move it to CANCELLED.

        Args:
            job: the job's id.
            by: who asks (recorded in the reason).

        Returns:
            The job's state afterwards (a terminal job keeps its state).
        """
        view = J.read_job(self.client, job)
        if view.state.state.is_terminal():
            return view.state.state.value
        try:
            self.client.put_json(self.client.key("jobs", job, "cancel"), {"at": time.time(), "by": by})
        except PermissionDenied as exc:
            raise PermissionDenied(f"etcd user {self.owner or '(none)'} may not cancel job {job}: a submitter "
                                   "cancels only its own jobs (docs/design.md §2, etcd roles); " + str(exc)) from exc
        new = J.update_state(self.client, job, JobEvent.CANCEL, reason=f"cancelled by {by}")
        if new is not None:
            append_event(self.client, job, "cancelled", by, {"by": by})
        return (new.state if new else J.read_job(self.client, job).state.state).value

    def remove(self, job: str, force: bool = False) -> None:
        """Delete a job's keys.

        Args:
            job: the job's id.
            force: remove a job that is not terminal too.

        Raises:
            ValueError: the job is not terminal and ``force`` is not set.
        """
        view = J.read_job(self.client, job)
        if not view.state.state.is_terminal() and not force:
            raise ValueError(f"job {job} is {view.state.state.value}: `marind cancel {job}` first, or pass --force")
        self.client.delete_prefix(self.client.key("jobs", job) + "/")
        J.mark_jobs_changed(self.client)

    def events(self, job: str) -> list[dict]:
        """The job's event ring, oldest first (``NotFound`` when there is no such job)."""
        J.read_job(self.client, job)
        return list_events(self.client, job)

    def state(self, job: str) -> JobState:
        """The job's state (``NotFound`` when there is no such job)."""
        return J.read_job(self.client, job).state.state

    def follow_events(self, job: str, on_event: Callable[[dict], None], *, poll: float = 0.5,
                      resync: float = 15.0, settle: float = 3.0) -> JobState:
        """Print the job's events as they are written until it is terminal.

        Every event already in the ring first, then the new ones as a watch on the job's keys
        reports changes. Once the job is terminal it ends when the event that records the end
        (``succeeded``/``failed``/``cancelled``) has been printed, or ``settle`` seconds later
        (a job cancelled or failed without one).

        Args:
            job: the job's id.
            on_event: called with each event, oldest first.
            poll: seconds between looks while nothing changes.
            resync: read again after this long even without a change.
            settle: how long to wait for the final event.

        Returns:
            The job's terminal state.
        """
        watch = ChangeWatch(self.client, resync_s=resync, prefix=self.client.key("jobs", job) + "/")
        last_seq, ended_at, final_seen = 0, None, False
        try:
            while True:
                watch.begin_read()
                state = self.state(job)
                for event in list_events(self.client, job, after=last_seq):    # the new ones, in order
                    on_event(event)
                    last_seq = event["seq"]
                    final_seen = final_seen or event.get("kind") in FINAL_EVENTS
                if state.is_terminal() and final_seen:
                    return state
                if state.is_terminal():
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at >= settle:
                        return state
                while not watch.due():
                    time.sleep(poll)
                    if ended_at is not None:
                        break
        finally:
            watch.stop()

    def wait(self, job: str, on_change=None, timeout: float | None = None, poll: float = 1.0,
             resync: float = 15.0) -> dict:
        """Follow a job until it is terminal; returns its last row.

        Reads the job when etcd reports a change under it (a watch on ``{p}/jobs/{job}/``), at
        most every ``poll`` seconds, and every ``resync`` seconds regardless; every ``poll``
        seconds while the watch is down. A job being followed costs the control plane a read
        per progress report, not a read per second.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = ChangeWatch(self.client, resync_s=resync, prefix=self.client.key("jobs", job) + "/")
        last = None
        try:
            while True:
                watch.begin_read()
                row = self.job(job)
                key = (row["state"], row["step"], row["restarts"])
                if key != last and on_change:
                    on_change(row)
                last = key
                if JobState(row["state"]).is_terminal():
                    return row
                while True:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"job {job} still {row['state']} after {timeout:.0f}s")
                    time.sleep(poll)
                    if watch.due():
                        break
        finally:
            watch.stop()


def local_log_files(job: str, state_dir: str | Path | None = None) -> list[Path]:
    """The job's log files on this machine (its run dir under the agent's state dir)."""
    import os

    from marind.control.config import SYSTEM_STATE_DIR, default_state_dir, user_state_dir
    dirs = [Path(state_dir)] if state_dir else []
    if os.environ.get("MARIND_STATE_DIR"):
        dirs.append(Path(os.environ["MARIND_STATE_DIR"]))
    dirs += [default_state_dir(), user_state_dir(), Path(SYSTEM_STATE_DIR)]
    for d in dirs:
        logs = d / "jobs" / job / "logs"
        if logs.is_dir():
            return sorted(p for p in logs.iterdir() if p.suffix == ".log")
    return []


def _last_step(reported: int | None, at_end: int | None) -> int | None:
    """Rank 0's reported step, or the step the job ended at when that is further (reports lag)."""
    if at_end is None:
        return reported
    return at_end if reported is None else max(int(reported), at_end)

"""A job's keys in etcd, read and written the one way (docs/design.md §2).

``update_state`` applies ``lifecycle.apply`` with compare-and-swap on the
state key's mod_revision, retrying on contention, so every agent and the
CLI move a job's state through the one transition function.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from marind.control.lifecycle import JobEvent, JobState, StateRecord, apply
from marind.core import etcd_txn as T
from marind.core.errors import NotFound, SpecError
from marind.core.etcd_client import EtcdClient
from marind.core.spec import RunSpec

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


def new_job_id(name: str, now: float | None = None) -> str:
    """A fresh job id: ``{name}-{UTC stamp}-{4 hex digits}``.

    Args:
        name: the job's ``job.name``.
        now: the time to stamp (default: now).

    Returns:
        The id.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def check_job_id(job: str) -> str:
    """A user-chosen job id, checked.

    Args:
        job: the id.

    Returns:
        ``job``.

    Raises:
        ValueError: it is not letters, digits, '.', '_' or '-' (starting with a letter or digit).
    """
    if not _JOB_ID_RE.match(job or ""):
        raise ValueError(f"bad job id {job!r}: expected letters, digits, '.', '_' or '-'")
    return job


@dataclass(frozen=True)
class JobView:
    """One job as read from etcd.

    ``spec`` is the stored document (``RunSpec.to_dict()`` as `marind submit` wrote it);
    ``run_spec`` the same parsed, or None when the document is not a valid spec (written by
    hand or by an older client: ``spec_error`` says why; the CLI still shows what it can).
    """

    id: str
    spec: dict
    state: StateRecord
    state_rev: int
    cancel: dict | None
    submitted_rev: int          # the spec key's revision: submission order
    run_spec: RunSpec | None = None
    spec_error: str | None = None

    def _job_field(self, name: str, default: Any) -> Any:
        if self.run_spec is not None:
            return getattr(self.run_spec.job, name)
        return (self.spec.get("job") or {}).get(name, default)

    @property
    def name(self) -> str:
        """``job.name`` (the id when the stored spec has none)."""
        return str(self._job_field("name", self.id))

    @property
    def nproc_per_node(self) -> int:
        """Slots the job needs on each node."""
        return int(self._job_field("nproc_per_node", 1))

    @property
    def target_steps(self) -> int | None:
        """``train.steps``: where the job ends."""
        if self.run_spec is not None:
            return self.run_spec.target_steps
        steps = (self.spec.get("train") or {}).get("steps")
        return None if steps is None else int(steps)


def parse_stored_spec(doc: Any) -> tuple[RunSpec | None, str | None]:
    """A stored spec document as a ``RunSpec``.

    Args:
        doc: the JSON value of ``{p}/jobs/{job}/spec``.

    Returns:
        (spec, None), or (None, why) when it is not a valid spec.
    """
    if not isinstance(doc, dict):
        return None, f"the stored spec is a {type(doc).__name__}, not a table"
    try:
        return RunSpec.from_dict(doc), None
    except (SpecError, TypeError, ValueError) as exc:
        return None, str(exc)


def job_state_key(client: EtcdClient, job: str) -> str:
    """``{p}/jobs/{job}/state``: the job's ``StateRecord`` (not the rendezvous' state key)."""
    return client.key("jobs", job, "state")


def list_job_ids(client: EtcdClient) -> list[str]:
    """Ids of every job with a spec (cheap: keys under {p}/jobs/ ending in /spec)."""
    base = client.key("jobs") + "/"
    ids = []
    for key in client.get_prefix_keys(base):
        rest = key[len(base):]
        if rest.endswith("/spec") and rest.count("/") == 1:
            ids.append(rest[:-5])
    return sorted(ids)


def read_job(client: EtcdClient, job: str) -> JobView:
    """Read one job's spec, state and cancel request.

    Args:
        client: the etcd client.
        job: the job's id.

    Returns:
        The job as read.

    Raises:
        NotFound: there is no such job.
        ControlPlaneUnavailable: etcd is unreachable.
    """
    spec_raw, spec_rev = client.get(client.key("jobs", job, "spec"))
    if spec_raw is None:
        raise NotFound(f"no job {job!r}: see `marind status` for the jobs there are")
    spec = json.loads(spec_raw)
    run_spec, spec_error = parse_stored_spec(spec)
    raw, rev = client.get(job_state_key(client, job))
    state = StateRecord.from_dict(json.loads(raw)) if raw else StateRecord(JobState.PENDING)
    cancel = client.get_json(client.key("jobs", job, "cancel"))
    return JobView(id=job, spec=spec, state=state, state_rev=rev, cancel=cancel, submitted_rev=spec_rev,
                   run_spec=run_spec, spec_error=spec_error)


def changed_key(client: EtcdClient) -> str:
    """The key every agent watches to know when to read the jobs again (``marind.control.change_watch``)."""
    return client.key("jobs_changed")


def mark_jobs_changed(client: EtcdClient) -> None:
    """Touch ``{p}/jobs_changed``: every agent reads the jobs again."""
    client.put(changed_key(client), repr(time.time()))


def signature_key(client: EtcdClient, job: str) -> str:
    """``{p}/jobs/{job}/signature``: the spec's signature record (``marind.control.job_signing``)."""
    return client.key("jobs", job, "signature")


def create_job(client: EtcdClient, job: str, spec: dict, now: float | None = None,
               signature: dict | None = None) -> bool:
    """Write spec (only if absent), with its signature in the same transaction, and the initial PENDING state.

    Args:
        client: the etcd client.
        job: the job's id.
        spec: the spec document (``RunSpec.to_dict()``).
        now: the time of submission (default: now).
        signature: the spec's signature record, or None (an unsigned job).

    Returns:
        True; False when the id exists.
    """
    now = time.time() if now is None else now
    spec_key, spec_json = client.key("jobs", job, "spec"), json.dumps(spec, sort_keys=True)
    if signature is None:
        created = client.create(spec_key, spec_json)
    else:     # an agent never sees the spec without its signature
        created = bool(client.txn([T.absent(spec_key)], [
            T.put(spec_key, spec_json), T.put(signature_key(client, job), json.dumps(signature, sort_keys=True))
        ]).succeeded)
    if not created:
        return False
    client.put_json(job_state_key(client, job),
                    StateRecord(JobState.PENDING, reason="submitted", updated_at=now).to_dict())
    mark_jobs_changed(client)
    return True


def update_state(client: EtcdClient, job: str, event: JobEvent, *, reason: str = "",
                 restarts: int | None = None, step: int | None = None,
                 attempts: int = 20) -> StateRecord | None:
    """Apply ``event`` by CAS; returns the new record, or None when the move was refused/no-op."""
    key = job_state_key(client, job)
    for _ in range(attempts):
        raw, rev = client.get(key)
        current = StateRecord.from_dict(json.loads(raw)) if raw else StateRecord(JobState.PENDING)
        new = apply(current, event, reason=reason, restarts=restarts, step=step)
        if new is None:
            return None
        ok, _ = client.compare_and_swap(key, json.dumps(new.to_dict(), sort_keys=True), rev)
        if ok:
            if new.state != current.state:
                mark_jobs_changed(client)
            return new
    raise RuntimeError(f"could not update the state of job {job} (contention)")


def job_nodes(client: EtcdClient, job: str) -> dict[str, dict]:
    """The job's per-node records (``{p}/jobs/{job}/nodes/*``), keyed by node."""
    rows = client.get_prefix_json(client.key("jobs", job, "nodes") + "/")
    return {k.rsplit("/", 1)[-1]: v for k, v in rows.items() if isinstance(v, dict)}

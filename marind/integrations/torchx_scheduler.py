"""The TorchX scheduler ``marind``: ``torchx run -s marind dist.ddp -j 2x2 --script train.py``.

Registered through TorchX's ``torchx.schedulers`` entry point (pyproject.toml):
``marind = "marind.integrations.torchx_scheduler:create_scheduler"``.

* submit/schedule: the AppDef becomes a marind run spec (``marind.integrations.torchx_spec``) stored as
  ``marind submit`` stores one; the app id is the marind job id (``marind://SESSION/JOB``).
* describe: the job's state (``APP_STATE``, docs/design.md §5 *TorchX*), restarts, reason, and one
  replica per node that runs it.
* log_iter: the job's logs on this machine (``{state_dir}/jobs/{job}/logs/*.log``, torchrun and the
  workers, stdout and stderr together), like ``marind logs``; ``should_tail`` follows them until the job ends.
* cancel: ``marind cancel``; delete: cancel, then ``marind rm``; list: every job on the control plane.

The control plane is found as every marind command finds it (docs/design.md §5): the run options
``etcd``/``config``/``state_dir``/``prefix`` at submit or list (kept for the scheduler's later calls), else
``create_scheduler``'s keyword arguments (TorchX passes ``TORCHX_ETCD``, ``TORCHX_STATE_DIR``, ... there), else
``MARIND_ETCD``, the config file, the local agent's state dir.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from torchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    filter_regex,
)
from torchx.specs import NONE, AppDef, AppDryRunInfo, AppState, CfgVal, ReplicaStatus, Role, RoleStatus, runopts

from marind.control import job_records as J
from marind.control.config import client_settings, resolve_endpoint, sign_key_setting
from marind.control.jobs_client import JobsClient, local_log_files
from marind.control.lifecycle import JobState
from marind.core.errors import NotFound, SpecError
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger
from marind.integrations.torchx_spec import MarindRequest, app_to_request

log = get_logger(__name__)

BACKEND = "marind"

#: marind job state -> TorchX AppState. RESTARTING is a live job re-forming its world after a failure
#: (its nodes held, its restarts counted in ``num_restarts``): RUNNING to TorchX, the reason in ``msg``.
APP_STATE: dict[JobState, AppState] = {
    JobState.PENDING: AppState.PENDING,
    JobState.RUNNING: AppState.RUNNING,
    JobState.RESTARTING: AppState.RUNNING,
    JobState.SUCCEEDED: AppState.SUCCEEDED,
    JobState.FAILED: AppState.FAILED,
    JobState.CANCELLED: AppState.CANCELLED,
}


def app_state(state: str) -> AppState:
    """A stored marind state (a ``JobState`` value) as TorchX's ``AppState``; UNKNOWN for anything else."""
    try:
        return APP_STATE[JobState(state)]
    except ValueError:
        return AppState.UNKNOWN


@dataclass
class Connection:
    """Where the control plane is (None: marind's documented discovery)."""

    etcd: str | None = None
    config: str | None = None
    state_dir: str | None = None
    prefix: str | None = None

    def open(self) -> EtcdClient:
        env = dict(os.environ, MARIND_STATE_DIR=self.state_dir) if self.state_dir else None
        endpoints, _ = resolve_endpoint(self.etcd, self.config, env=env)
        settings = client_settings(self.config)
        if self.prefix:
            settings["prefix"] = self.prefix
        client = EtcdClient(endpoints, **settings)
        client.ping()
        return client


def _str_opt(cfg: Mapping[str, CfgVal], key: str) -> str | None:
    value = cfg.get(key)
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or None
    return None if value in (None, "") else str(value)


def _connection(cfg: Mapping[str, CfgVal]) -> Connection:
    return Connection(_str_opt(cfg, "etcd"), _str_opt(cfg, "config"), _str_opt(cfg, "state_dir"),
                      _str_opt(cfg, "prefix"))


class MarindScheduler(Scheduler[Mapping[str, CfgVal]]):
    """TorchX's view of a marind cluster (module docstring)."""

    def __init__(self, session_name: str, *, etcd: str | None = None, config: str | None = None,
                 state_dir: str | None = None, prefix: str | None = None) -> None:
        super().__init__(BACKEND, session_name)
        self._conn = Connection(etcd, config, state_dir, prefix)
        self._client: EtcdClient | None = None

    # ------------------------------------------------------------ control plane
    def _jobs(self) -> JobsClient:
        if self._client is None:
            self._client = self._conn.open()
        return JobsClient(self._client, owner=client_settings(self._conn.config)["user"])   # ids USER.* under auth

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------ submit
    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add("etcd", type_=list[str], default=None,
                 help="etcd endpoints (http://HOST:2379,...); default: $MARIND_ETCD, the config file, the local agent's")
        opts.add("config", type_=str, default=None, help="marind.toml (default $MARIND_CONFIG, /etc/marind/marind.toml)")
        opts.add("state_dir", type_=str, default=None,
                 help="the local agent's state dir: its etcd.endpoint, and where `torchx log` reads the job's logs")
        opts.add("prefix", type_=str, default=None, help="etcd key prefix (default $MARIND_PREFIX, the config's, /marind)")
        opts.add("working_dir", type_=str, default=None,
                 help="the workers' cwd, the same path on every node (default: this directory)")
        opts.add("max_restarts", type_=int, default=None,
                 help="job.max_restarts (default: the role's max_retries when > 0, else marind's 3)")
        opts.add("hang_timeout", type_=str, default=None, help="job.hang_timeout, e.g. 120s (default marind's 300s)")
        opts.add("run_toml", type_=str, default=None,
                 help="a base run.toml ([checkpoint], [fault], the program's sections); the AppDef's [job] keys win")
        return opts

    def _submit_dryrun(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppDryRunInfo:
        restarts = cfg.get("max_restarts")
        request = app_to_request(app, working_dir=_str_opt(cfg, "working_dir"),
                                 max_restarts=restarts if isinstance(restarts, int) else None,
                                 hang_timeout=_str_opt(cfg, "hang_timeout"), run_toml=_str_opt(cfg, "run_toml"))
        return AppDryRunInfo(_Submission(request, _connection(cfg)), lambda s: s.request.describe())

    def _use(self, conn: Connection) -> None:
        """Connect as the run options say from now on (what they leave out stays as it was)."""
        if any((conn.etcd, conn.config, conn.state_dir, conn.prefix)):
            self._conn = Connection(conn.etcd or self._conn.etcd, conn.config or self._conn.config,
                                    conn.state_dir or self._conn.state_dir, conn.prefix or self._conn.prefix)
            self.close()

    def schedule(self, dryrun_info: AppDryRunInfo) -> str:
        submission: _Submission = dryrun_info.request
        self._use(submission.connection)
        req = submission.request
        try:
            job = self._jobs().submit(req.spec, req.spec["job"]["name"], req.job_id,
                                      sign_key=sign_key_setting(None, self._conn.config))   # signed jobs (§2)
        except ValueError as exc:
            raise SpecError(str(exc)) from exc
        log.info("torchx_job_submitted", job=job, role=req.role, session=self.session_name)
        return job

    # ------------------------------------------------------------ read
    def describe(self, app_id: str) -> DescribeAppResponse | None:
        jc = self._jobs()
        try:
            row = jc.job(app_id)
        except NotFound:
            return None
        except ValueError as exc:           # a state record this client cannot read
            return DescribeAppResponse(app_id=app_id, state=AppState.UNKNOWN, msg=str(exc))
        state = app_state(row["state"])
        spec = jc.client.get_json(jc.client.key("jobs", app_id, "spec")) or {}
        job = spec.get("job") or {}
        lo, _, hi = str(job.get("nodes", "1:1")).partition(":")
        command = list(job.get("command") or ["python", "-m", str(job.get("entrypoint", "marind.trainer"))])
        role = Role(name=str(job.get("name", row["name"])), image="", entrypoint=command[0], args=command[1:],
                    env=dict(job.get("env") or {}), num_replicas=int(hi or lo), min_replicas=int(lo))
        records = J.job_nodes(jc.client, app_id)
        replicas = [ReplicaStatus(id=i, state=state, role=role.name, hostname=str(records[node].get("host", node)))
                    for i, node in enumerate(sorted(records))]
        reason = row["reason"] or ""
        msg = f"RESTARTING: {reason}" if row["state"] == JobState.RESTARTING.value else reason
        metadata = {"marind.state": row["state"], "marind.nodes": ",".join(row["nodes"]),
                    "marind.world_size": str(row["world_size"]), "marind.step": str(row["step"])}
        error = row.get("last_error")
        return DescribeAppResponse(
            app_id=app_id, state=state, num_restarts=int(row["restarts"]), msg=msg,
            structured_error_msg=_json(error) if state == AppState.FAILED and error else NONE,
            metadata=metadata, roles=[role], roles_statuses=[RoleStatus(role.name, replicas)])

    def list(self, cfg: Mapping[str, CfgVal] | None = None) -> list[ListAppResponse]:
        self._use(_connection(cfg or {}))
        return [ListAppResponse(app_id=row["id"], state=app_state(row["state"]), name=row["name"],
                                app_handle=f"{BACKEND}://{self.session_name}/{row['id']}")
                for row in self._jobs().jobs()]

    # ------------------------------------------------------------ stop
    def _cancel_existing(self, app_id: str) -> None:
        by = f"{getpass.getuser()}@{socket.gethostname()} (torchx)"
        state = self._jobs().cancel(app_id, by)
        log.info("torchx_job_cancel", job=app_id, state=state)

    def _delete_existing(self, app_id: str) -> None:
        self._cancel_existing(app_id)
        self._jobs().remove(app_id, force=True)

    # ------------------------------------------------------------ logs
    def log_iter(self, app_id: str, role_name: str, k: int = 0, regex: str | None = None,
                 since: datetime | None = None, until: datetime | None = None, should_tail: bool = False,
                 streams: Stream | None = None) -> Iterable[str]:
        """This machine's log lines of the job (torchrun and its workers; any ``k``: one node's logs).

        Raises:
            ValueError: ``streams`` asks for stdout or stderr alone (marind keeps them together), or the
                job has no logs here and is not to be followed.
        """
        if streams not in (None, Stream.COMBINED):
            raise ValueError(f"marind keeps stdout and stderr in one log per node; ask for --streams combined "
                             f"(or none) instead of {streams.value}")
        if since or until:
            log.warning("torchx_log_time_range_ignored", job=app_id, reason="marind's logs are read whole")
        state_dir = self._conn.state_dir
        if not should_tail and not local_log_files(app_id, state_dir):
            raise ValueError(f"no logs of job {app_id} on this machine: run `torchx log` on a node that ran it "
                             "(see `marind status`), or pass the agent's state dir (-cfg state_dir=... at submit, "
                             "or MARIND_STATE_DIR)")
        lines: Iterable[str] = _follow(app_id, state_dir, self._jobs() if should_tail else None)
        return filter_regex(regex, lines) if regex else lines


@dataclass
class _Submission:
    request: MarindRequest
    connection: Connection


def _json(value: Any) -> str:
    import json
    return json.dumps(value, sort_keys=True)


def _follow(job: str, state_dir: str | None, jobs: JobsClient | None, poll: float = 0.5) -> Iterator[str]:
    """Whole lines of the job's local logs; with ``jobs``, new ones until the job is terminal."""
    offsets: dict[Path, int] = {}
    partial: dict[Path, str] = {}
    done = False
    while True:
        for path in local_log_files(job, state_dir):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            offset = offsets.get(path, 0)
            if size < offset:
                offset = 0
            if size > offset:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read(size - offset)
                offsets[path] = offset + len(data)
                text = partial.pop(path, "") + data.decode(errors="replace")
                *whole, rest = text.split("\n")
                yield from (line + "\n" for line in whole)
                if rest:
                    partial[path] = rest
        if jobs is None or done:
            yield from (rest + "\n" for rest in partial.values())
            return
        done = jobs.state(job).is_terminal()     # one more read after the end: the workers' last lines
        time.sleep(poll)


def create_scheduler(session_name: str, **kwargs: Any) -> MarindScheduler:
    """TorchX's factory (entry point ``torchx.schedulers``: ``marind``).

    Args:
        session_name: the TorchX session.
        **kwargs: ``etcd``, ``config``, ``state_dir``, ``prefix`` (where the control plane is); TorchX also
            passes every ``TORCHX_*`` environment variable here, which are ignored.
    """
    known = {k: str(kwargs[k]) for k in ("etcd", "config", "state_dir", "prefix") if kwargs.get(k)}
    return MarindScheduler(session_name, **known)

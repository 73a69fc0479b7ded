"""Who may write what under marind's prefix: the etcd roles (docs/design.md §2, "etcd roles").

etcd v3 grants read/write on keys and key prefixes, so a user's jobs live under a prefix of
their own: a job submitted by etcd user ``alice`` has an id starting ``alice.``
(``owned_job_id``), and its keys ``{p}/jobs/alice.*`` are what alice's role may write.

* ``marind-viewer``: read ``{p}/jobs/``, ``{p}/nodes/`` and ``{p}/jobs_changed`` (`status`,
  `events`, `nodes`, `logs -f` of the state); no write anywhere.
* ``marind-submitter``: the viewer's reads, and write ``{p}/jobs_changed`` (wakes the agents);
  ``marind-submitter-{user}``: read-write ``{p}/jobs/{user}.`` (create, cancel, `rm` its own
  jobs). Nothing of ``{p}/nodes/``, another user's jobs, ``{p}/doctor/``.
* ``marind-agent``: read-write ``{p}/`` (node records, every job's records, the rendezvous,
  doctor probes); the agents' own etcd user.

``plan`` is pure; ``etcdctl_commands`` prints it; ``marind.core.etcd_auth`` applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VIEWER = "marind-viewer"
SUBMITTER = "marind-submitter"
AGENT = "marind-agent"
KINDS = ("viewer", "submitter", "agent")

_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class Grant:
    """One permission of one role: ``perm`` (read, write, readwrite) on ``key``, a prefix or one key."""

    role: str
    perm: str
    key: str
    prefix: bool


@dataclass(frozen=True)
class Plan:
    """The roles, their grants, and which user gets which roles."""

    roles: tuple[str, ...]
    grants: tuple[Grant, ...]
    users: tuple[tuple[str, tuple[str, ...]], ...]     # (user, roles)


def check_user(user: str) -> str:
    """A marind etcd user name: letters, digits, '_' or '-' (no '.': it ends the owner prefix)."""
    if not _USER_RE.match(user or ""):
        raise ValueError(f"bad etcd user name {user!r} for marind: use letters, digits, '_' or '-' "
                         "(no '.': a user's job ids start with 'USER.')")
    return user


def owner_prefix(user: str) -> str:
    """The start of every job id of etcd user ``user``: ``user.``."""
    return f"{user}."


def owned_job_id(owner: str | None, job_id: str) -> str:
    """The job id a submitter stores under: ``job_id`` prefixed with ``owner.`` (unless it has it).

    Args:
        owner: the submitting etcd user (None: no auth, the id as given).
        job_id: the id chosen (``--id``) or generated.

    Returns:
        The id.
    """
    if not owner or job_id.startswith(owner_prefix(owner)):
        return job_id
    return owner_prefix(owner) + job_id


def submitter_role(user: str) -> str:
    """The per-user role of submitter ``user``: read-write on its own jobs."""
    return f"{SUBMITTER}-{check_user(user)}"


def plan(prefix: str, *, viewers: list[str] | tuple[str, ...] = (), submitters: list[str] | tuple[str, ...] = (),
         agents: list[str] | tuple[str, ...] = ()) -> Plan:
    """The roles and grants for ``prefix`` and the users given.

    Args:
        prefix: marind's key prefix (``/marind``).
        viewers, submitters, agents: etcd user names for each kind.

    Returns:
        The plan (roles in the order to create them).
    """
    p = "/" + prefix.strip("/")
    reads = [(f"{p}/jobs/", True), (f"{p}/nodes/", True), (f"{p}/jobs_changed", False)]
    grants = [Grant(VIEWER, "read", k, pre) for k, pre in reads]
    grants += [Grant(SUBMITTER, "read", k, pre) for k, pre in reads if k != f"{p}/jobs_changed"]
    grants.append(Grant(SUBMITTER, "readwrite", f"{p}/jobs_changed", False))
    grants.append(Grant(AGENT, "readwrite", f"{p}/", True))
    roles = [VIEWER, SUBMITTER, AGENT]
    users: list[tuple[str, tuple[str, ...]]] = []
    for user in submitters:
        own = submitter_role(user)
        roles.append(own)
        grants.append(Grant(own, "readwrite", f"{p}/jobs/{owner_prefix(user)}", True))
        users.append((user, (SUBMITTER, own)))
    users += [(check_user(u), (VIEWER,)) for u in viewers]
    users += [(check_user(u), (AGENT,)) for u in agents]
    names = [u for u, _ in users]
    twice = sorted({u for u in names if names.count(u) > 1})
    if twice:
        raise ValueError(f"etcd user(s) {', '.join(twice)} named for more than one kind: give each user one kind")
    return Plan(tuple(roles), tuple(grants), tuple(users))


def etcdctl_commands(p: Plan, *, enable: bool = False) -> list[str]:
    """The plan as ``etcdctl`` commands (passwords asked for interactively by etcdctl)."""
    out = []
    if enable:
        out += ["etcdctl user add root", "etcdctl role add root", "etcdctl user grant-role root root"]
    out += [f"etcdctl role add {r}" for r in p.roles]
    for g in p.grants:
        out.append(f"etcdctl role grant-permission {g.role} {'--prefix=true ' if g.prefix else ''}{g.perm} {g.key}")
    for user, roles in p.users:
        out.append(f"etcdctl user add {user}")
        out += [f"etcdctl user grant-role {user} {r}" for r in roles]
    if enable:
        out.append("etcdctl auth enable")
    return out

"""`marind auth roles | setup` and `marind keygen`: who may do what (docs/design.md §2, §5).

``auth roles`` prints the etcdctl commands that create marind's etcd roles and users;
``auth setup`` makes them itself (idempotent), and with ``--enable`` creates etcd's root
user and turns auth on. ``keygen`` writes an Ed25519 key pair for signed jobs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from marind.commands.jobs import common_flags


def register(sub) -> None:
    p = sub.add_parser("auth", help="etcd roles and users for marind (viewer, submitter, agent)")
    verbs = p.add_subparsers(dest="auth_command", metavar="VERB", parser_class=type(p))
    for verb, help_text in (("roles", "print the etcdctl commands that create the roles and users"),
                            ("setup", "create the roles and users in etcd (as etcd's root user, or before auth)")):
        q = verbs.add_parser(verb, help=help_text)
        q.add_argument("--viewer", action="append", default=[], metavar="USER", help="a user that reads status/events")
        q.add_argument("--submitter", action="append", default=[], metavar="USER",
                       help="a user that submits and cancels its own jobs (ids USER.*)")
        q.add_argument("--agent", action="append", default=[], metavar="USER", help="the agents' etcd user")
        q.add_argument("--prefix", help="marind's key prefix (default: $MARIND_PREFIX, the config file, /marind)")
        q.add_argument("--enable", action="store_true", help="also create etcd's root user and turn auth on")
        if verb == "setup":
            q.add_argument("--passwords", required=True, metavar="FILE",
                           help="lines USER:PASSWORD for every user named (and root with --enable)")
            common_flags(q)
        q.set_defaults(handler=roles if verb == "roles" else setup)

    p = sub.add_parser("keygen", help="write an Ed25519 key pair for signed jobs (PATH and PATH.pub)")
    p.add_argument("path", help="the private key file to write (the public key goes to PATH.pub)")
    p.set_defaults(handler=keygen)


def _plan(args):
    from marind.control.auth_roles import plan
    from marind.control.config import client_settings
    prefix = args.prefix or client_settings(getattr(args, "config", None))["prefix"]
    return plan(prefix, viewers=args.viewer, submitters=args.submitter, agents=args.agent)


def roles(args) -> int:
    from marind.control.auth_roles import etcdctl_commands
    print("\n".join(etcdctl_commands(_plan(args), enable=args.enable)))
    return 0


def read_passwords(path: str) -> dict[str, str]:
    """``USER:PASSWORD`` lines (``#`` comments, blank lines skipped)."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"{path}:{n}: expected USER:PASSWORD")
        out[user.strip()] = password
    return out


def setup(args) -> int:
    from marind.control.jobs_client import connect
    from marind.core import etcd_auth

    p = _plan(args)                                 # bad names fail before anything is written
    passwords = read_passwords(args.passwords)
    needed = [u for u, _ in p.users] + (["root"] if args.enable else [])
    missing = [u for u in needed if u not in passwords]
    if missing:
        raise ValueError(f"{args.passwords} has no password for {', '.join(missing)}: add USER:PASSWORD lines")
    client = connect(args.etcd, args.config, args.state_dir)
    try:
        for role in p.roles:
            etcd_auth.add_role(client, role)
        for g in p.grants:
            etcd_auth.grant(client, g.role, g.perm, g.key, g.prefix)
        for user, user_roles in p.users:
            etcd_auth.add_user(client, user, passwords[user])
            for role in user_roles:
                etcd_auth.grant_role(client, user, role)
        if args.enable:
            etcd_auth.add_user(client, "root", passwords["root"])
            etcd_auth.add_role(client, "root")
            etcd_auth.grant_role(client, "root", "root")
            etcd_auth.enable(client)
    finally:
        client.close()
    for user, user_roles in p.users:
        print(f"{user}: {', '.join(user_roles)}")
    if args.enable:
        print("auth enabled (etcd user root)")
    return 0


def keygen(args) -> int:
    from marind.control.job_signing import key_id, load_private_key
    from marind.control.job_signing import keygen as make
    private, public = make(args.path)
    kid = key_id(load_private_key(private).public_key())
    print(f"private key: {private} (keep it; `marind submit --sign-key {private}`)\n"
          f"public key:  {public} (list it in the agents' [agent] trusted_keys)\nkey id:      {kid}")
    sys.stdout.flush()
    return 0

"""etcd's auth admin calls (roles, users, grants, enabling auth) for `marind auth setup`.

Only the setup command needs these, so they sit beside the one client
(``marind.core.etcd_client``) rather than in it: each call goes through the client's
channel and login (its auth stub, token and credentials). Every call is idempotent: a role
or user that exists, or a grant already given, is not an error, so setup can be run again.
"""

from __future__ import annotations

from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.etcd_txn import prefix_end

_PERMS = {"read": auth_pb2.Permission.READ, "write": auth_pb2.Permission.WRITE,
          "readwrite": auth_pb2.Permission.READWRITE}
_EXISTS = ("already exists", "already granted")


def _send(client: EtcdClient, method: str, request: Any) -> bool:
    """One auth call; True when it changed something, False when it was already so."""
    inner = client._client            # the one client's channel, token and credentials
    try:
        getattr(inner.authstub, method)(request, client.timeout, credentials=inner.call_credentials,
                                        metadata=inner.metadata)
        return True
    except grpc.RpcError as exc:
        details = exc.details() if hasattr(exc, "details") else ""
        if details and any(s in details for s in _EXISTS):
            return False
        raise ControlPlaneUnavailable(
            f"etcd at {client.endpoints_spec} refused {method} ({details or exc.code()}): "
            "run `marind auth setup` as etcd's root user (--user root), or before auth is enabled") from exc


def add_role(client: EtcdClient, role: str) -> bool:
    return _send(client, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role))


def grant(client: EtcdClient, role: str, perm: str, key: str, prefix: bool) -> bool:
    """Grant ``perm`` (read, write, readwrite) on ``key`` (a prefix when ``prefix``) to ``role``."""
    permission = auth_pb2.Permission(permType=_PERMS[perm], key=key.encode(),
                                     range_end=prefix_end(key) if prefix else b"")
    return _send(client, "RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=permission))


def add_user(client: EtcdClient, user: str, password: str) -> bool:
    return _send(client, "UserAdd", etcdrpc.AuthUserAddRequest(name=user, password=password))


def grant_role(client: EtcdClient, user: str, role: str) -> bool:
    return _send(client, "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))


def enable(client: EtcdClient) -> bool:
    """Turn auth on (etcd needs a ``root`` user with the ``root`` role first)."""
    return _send(client, "AuthEnable", etcdrpc.AuthEnableRequest())

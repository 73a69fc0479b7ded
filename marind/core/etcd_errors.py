"""What an etcd failure means, in one place: which ones to try on another member, and the error
each becomes (``EtcdClient`` turns every one into ``ControlPlaneUnavailable`` or a subclass).

* An etcd that does not answer (down, between leaders, the network): ``ControlPlaneUnavailable``,
  "etcd unreachable"; callers retry it for their grace.
* An etcd that answers and refuses the request, which no retry and no other member changes: a
  request over its size limit or with too many operations, its database at its space quota
  (the NOSPACE alarm: every write refused), a revision compacted away, a malformed request:
  ``ControlPlaneRefused``, naming what etcd said and the fix; ``with_grace`` does not retry it.
* A user its roles do not allow, or a login that failed: ``PermissionDenied`` and an auth message.
"""

from __future__ import annotations

import grpc
from etcd3 import exceptions as etcd_exc

from marind.core.errors import ControlPlaneRefused, ControlPlaneUnavailable, PermissionDenied

#: every failure a call can meet on its way to etcd
TRANSIENT = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError, etcd_exc.Etcd3Exception, grpc.RpcError)
#: failures after which a call goes to the next member: the member did not take the request
FAIL_OVER = (etcd_exc.ConnectionFailedError, etcd_exc.NoServerAvailableError)
#: gRPC codes with which an answering etcd refuses a request for what it is (not FAILED_PRECONDITION:
#: etcd also says "not leader" with it, which another try may not meet)
REFUSED_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.OUT_OF_RANGE})
#: what etcd says with one of those codes when a later try may pass: its apply loop lagging
_PASSING = ("too many requests",)

#: what etcd says -> what to do about it
_FIXES = (
    ("database space exceeded", "its database reached its space quota and it refuses every write (the "
     "NOSPACE alarm): compact and defragment it (`etcdctl compact`, `etcdctl defrag`), disarm the "
     "alarm (`etcdctl alarm disarm`), or raise --quota-backend-bytes; marind agents compact it "
     "every agent.etcd_compact_interval"),
    ("request is too large", "raise etcd's --max-request-bytes, or report the request to marind: no "
     "request of marind's should reach it"),
    ("too many operations in txn", "raise etcd's --max-txn-ops to at least 128 (its default)"),
    ("has been compacted", "the revision asked for is older than etcd's last compaction: read again "
     "from now"),
)


def grpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc`` (itself, or what the etcd3 library raised it from)."""
    seen: BaseException | None = exc
    for _ in range(3):
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            return seen
        seen = seen.__cause__ or seen.__context__ if seen is not None else None
    return None


def refused(exc: BaseException) -> bool:
    """Did an answering etcd refuse the request for what it is (no retry helps)?"""
    err = grpc_error(exc)
    try:
        if err is None or err.code() not in REFUSED_CODES:
            return False
        details = err.details() or ""
    except Exception:  # noqa: BLE001 - a gRPC error without a status is no refusal
        return False
    return not any(said in details for said in _PASSING)


def is_stale_token(exc: grpc.RpcError) -> bool:
    """etcd forgot the auth token (it restarted, or the token expired): log in again."""
    details = exc.details() if hasattr(exc, "details") else ""
    return bool(details) and ("invalid auth token" in details or "revision of auth store is old" in details)


def control_plane_error(exc: BaseException, endpoints: str, user: str | None) -> ControlPlaneUnavailable:
    """The one error a caller gets for ``exc`` (module doc), with what etcd said and the fix."""
    err = grpc_error(exc)
    details = ""
    if err is not None and hasattr(err, "details"):
        details = err.details() or ""
    if details and "authentication failed" in details:
        return ControlPlaneUnavailable(
            f"etcd at {endpoints} rejected user {user!r}: {details}; check the etcd user and password")
    if details and ("permission denied" in details or "user name is empty" in details):
        return PermissionDenied(
            f"etcd at {endpoints} refused user {user or '(none)'} ({details}): "
            "give an etcd user whose roles allow it (user/password, docs/design.md §2)")
    if refused(exc):
        fix = next((f for said, f in _FIXES if said in details), "a request etcd will not take, which no retry "
                   "changes: report it to marind with this line")
        return ControlPlaneRefused(f"etcd at {endpoints} refused the request ({details or type(exc).__name__}): {fix}")
    return ControlPlaneUnavailable(
        f"etcd unreachable at {endpoints} ({type(exc).__name__}): "
        "check that etcd is running, or pass --etcd / set MARIND_ETCD")

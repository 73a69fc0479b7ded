"""The one etcd v3 client wrapper in marind.

Built on ``cslab-etcd3`` (``import etcd3``), a maintained fork of
python-etcd3 whose generated protobuf code imports with protobuf >= 4
(the upstream 0.12.0 fails with "Descriptors cannot be created
directly"). It is synchronous, which fits torch's synchronous
``RendezvousBackend`` interface and the agent's supervision loop.

Every gRPC failure is turned into ``ControlPlaneUnavailable`` (or a subclass)
naming the endpoints, so callers handle one exception type
(``marind.core.etcd_errors``: what each failure means).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3 import exceptions as etcd_exc

from marind.core.errors import ControlPlaneRefused, ControlPlaneUnavailable
from marind.core.etcd_endpoints import GRPC_OPTIONS, EtcdTLS, parse_endpoints, read_file
from marind.core.etcd_errors import FAIL_OVER as _FAIL_OVER
from marind.core.etcd_errors import TRANSIENT as _TRANSIENT
from marind.core.etcd_errors import control_plane_error, is_stale_token, refused

DEFAULT_PREFIX = "/marind"

class EtcdClient:
    """Key/value, compare-and-swap, leases, watches and locks on etcd v3."""

    def __init__(self, endpoints: str | list[str], *, prefix: str = DEFAULT_PREFIX,
                 user: str | None = None, password: str | None = None,
                 tls: EtcdTLS | None = None, timeout: float = 5.0):
        self.endpoints_spec = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
        self.prefix = prefix.rstrip("/")
        self.timeout = timeout
        parsed = parse_endpoints(endpoints)
        tls = tls or EtcdTLS()
        secure = any(s for _, _, s in parsed) or bool(tls.ca_cert)
        self._user, self._password, self._secure = user, password, secure
        try:
            self._connect(parsed, secure, tls, user, password)
        except _TRANSIENT as exc:
            raise self._unavailable(exc) from exc

    def _connect(self, parsed, secure, tls, user, password) -> None:
        timeout = self.timeout
        host, port, _ = parsed[0]
        single = len(parsed) == 1 and (not secure or tls.ca_cert)
        if single:
            # (an https endpoint without a CA file takes the path below: etcd3.client would
            # open a plaintext channel to it; ssl_channel_credentials uses the system roots)
            self._client = etcd3.client(
                host=host, port=port, timeout=timeout, user=user, password=password,
                ca_cert=tls.ca_cert if secure else None,
                cert_key=tls.key if secure else None,
                cert_cert=tls.cert if secure else None, grpc_options=GRPC_OPTIONS)
        else:
            creds = None
            if secure:
                creds = grpc.ssl_channel_credentials(
                    read_file(tls.ca_cert), read_file(tls.key), read_file(tls.cert))
            eps = [etcd3.Endpoint(h, p, secure=secure, creds=creds, opts=GRPC_OPTIONS)
                   for h, p, _ in parsed]
            # no credentials yet: the library would log in at construction on one member drawn
            # at random, and fail if that one is down; ``_authenticate`` fails over instead
            self._client = etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout, failover=True)
        # etcd3 shuns an endpoint for 300 s after one failed call, which would outlast any
        # etcd restart; retry a lone endpoint at once, and fail over among several quickly.
        for endpoint in self._client.endpoints.values():
            endpoint.time_retry = 0.0 if len(parsed) == 1 else 2.0
        if user and not single:
            self._authenticate(secure)
        if user and not secure:
            # gRPC refuses call credentials on a plaintext channel ("insufficient security
            # level"); the auth token still travels as plain metadata, which etcd accepts.
            self._client.call_credentials = None

    def _authenticate(self, secure: bool) -> None:
        """Log in (on any member that answers) and attach the token to every later call."""
        from etcd3.client import EtcdTokenCallCredentials
        from etcd3.etcdrpc import AuthenticateRequest
        request = AuthenticateRequest(name=self._user, password=self._password)
        # the stub is looked up per try: after a failover it belongs to the next member's channel
        resp = self._call(lambda: self._client.authstub.Authenticate(request, self.timeout))
        self._client.metadata = (("token", resp.token),)
        if secure:
            self._client.call_credentials = grpc.metadata_call_credentials(
                EtcdTokenCallCredentials(resp.token))

    # -- keys ---------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *[p.strip("/") for p in parts]])

    def _call(self, fn: Callable, *args, **kwargs):
        return self._call_tracked(fn, *args, **kwargs)[0]

    def _call_tracked(self, fn: Callable, *args, **kwargs) -> tuple[Any, bool]:
        """(``fn``'s result, whether it was sent to another member after a failure).

        With several endpoints, a member that does not answer (down, or between leaders) is
        marked failed by the etcd3 library and the call goes to the next one, each member
        tried at most once: one member of three down fails no call. A member that does not
        answer in time (the leader killed while it held the request) is left for the next one
        once per call, so a call waits at most two timeouts. A retried write may have landed
        on the first member: the writes that are not idempotent (create, compare-and-swap,
        delete-if) check for that (see ``create``).
        """
        tries = len(self._client.endpoints)
        timeouts_left = 1
        tried: set[str] = set()
        for attempt in range(tries):
            tried.add(self._client._current_endpoint_label)
            try:
                try:
                    return fn(*args, **kwargs), attempt > 0
                except grpc.RpcError as exc:
                    if not (self._user and is_stale_token(exc)):
                        raise
                    self._reauthenticate()  # etcd restarted or the token expired: log in again
                    return fn(*args, **kwargs), attempt > 0
            except _TRANSIENT as exc:
                if refused(exc):                    # etcd answered: no other member changes that
                    raise self._unavailable(exc) from exc
                retry = isinstance(exc, _FAIL_OVER)
                if isinstance(exc, etcd_exc.ConnectionTimeoutError) and timeouts_left:
                    timeouts_left, retry = timeouts_left - 1, True
                untried = [label for label in self._client.endpoints if label not in tried]
                if not (retry and untried):
                    raise self._unavailable(exc) from exc
                # the next member not tried in this call (the library, left alone, may go back
                # to one that failed seconds ago once its retry time has passed)
                self._client._current_endpoint_label = untried[0]
        raise AssertionError("unreachable")   # the loop returns or raises

    def _unavailable(self, exc: BaseException) -> ControlPlaneUnavailable:
        return control_plane_error(exc, self.endpoints_spec, self._user)

    def _reauthenticate(self) -> None:
        from etcd3.etcdrpc import AuthenticateRequest
        resp = self._client.authstub.Authenticate(
            AuthenticateRequest(name=self._user, password=self._password), self.timeout)
        self._client.metadata = (("token", resp.token),)
        watcher = self._client._stubs.get("watcher")
        if watcher is not None:
            watcher._metadata = self._client.metadata

    def get(self, key: str) -> tuple[bytes | None, int]:
        """Value and mod_revision (0 when absent)."""
        value, meta = self._call(self._client.get, key)
        return value, (meta.mod_revision if meta is not None else 0)

    def get_with_revision(self, key: str) -> tuple[bytes | None, int, int]:
        """Value, mod_revision (0 when absent) and the store's revision at the read."""
        resp = self._call(self._client.get_response, key)
        if resp.kvs:
            return resp.kvs[0].value, resp.kvs[0].mod_revision, resp.header.revision
        return None, 0, resp.header.revision

    def wait_for_key(self, key: str, timeout: float) -> bytes | None:
        """The key's value, waiting (by watch) up to ``timeout`` s for it to appear; None on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value, _, revision = self.get_with_revision(key)
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                # start after our read, so a put between the read and the watch is not missed;
                # short slices bound the wait even if the watch stream breaks
                self._client.watch_once_response(
                    key, timeout=min(remaining, 1.0), start_revision=revision + 1)
            except etcd_exc.WatchTimedOut:
                pass
            except _TRANSIENT as exc:
                raise self._unavailable(exc) from exc

    def count_prefix(self, prefix: str) -> int:
        resp = self._call(self._client.get_prefix_response, prefix, count_only=True)
        return resp.count

    def get_json(self, key: str, default: Any = None) -> Any:
        value, _ = self.get(key)
        return json.loads(value) if value is not None else default

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
        rows = self._call(lambda: list(self._client.get_prefix(prefix)))
        return [(meta.key.decode(), value, meta.mod_revision) for value, meta in rows]

    def get_prefix_keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` without their values (cheap listings)."""
        rows = self._call(lambda: list(self._client.get_prefix(prefix, keys_only=True)))
        return [meta.key.decode() for _, meta in rows]

    def get_prefix_json(self, prefix: str) -> dict[str, Any]:
        out = {}
        for key, value, _ in self.get_prefix(prefix):
            try:
                out[key] = json.loads(value)
            except ValueError:
                continue
        return out

    def put(self, key: str, value: bytes | str, lease: etcd3.Lease | None = None) -> int:
        resp = self._call(self._client.put, key, value, lease=lease)
        return resp.header.revision

    def put_json(self, key: str, obj: Any, lease=None) -> int:
        return self.put(key, json.dumps(obj, sort_keys=True), lease=lease)

    def create(self, key: str, value: bytes | str, lease=None) -> bool:
        """Put only if the key does not exist; True when this call created it.

        A create sent again to another member after a failure finds the key there when the
        first member had taken it: a key holding our value under our lease is ours.
        """
        created, retried = self._call_tracked(self._client.put_if_not_exists, key, value, lease=lease)
        if created or not retried:
            return bool(created)
        return self._holds(key, value, lease)

    def _holds(self, key: str, value: bytes | str, lease=None) -> bool:
        """Does ``key`` hold ``value`` (under ``lease``, when given)? The check after a retried write."""
        current, meta = self._call(self._client.get, key)
        data = value.encode() if isinstance(value, str) else value
        if current != data or meta is None:
            return False
        return lease is None or int(getattr(meta, "lease_id", 0)) == int(getattr(lease, "id", 0))

    def compare_and_swap(self, key: str, value: bytes | str, mod_revision: int,
                         lease=None) -> tuple[bool, int]:
        """Write ``value`` iff the key's mod_revision is still ``mod_revision`` (0: absent).

        Returns (succeeded, new mod_revision or the current one on failure).
        """
        txn = self._client.transactions
        if mod_revision == 0:
            compare = [txn.version(key) == 0]
        else:
            compare = [txn.mod(key) == mod_revision]
        (ok, responses), retried = self._call_tracked(
            self._client.transaction, compare=compare,
            success=[txn.put(key, value, lease=lease)], failure=[txn.get(key)])
        if ok:
            return True, responses[0].response_put.header.revision
        current = 0
        stored = None
        for item in responses[0] if responses else []:
            stored, current = item[0], item[1].mod_revision
        if retried and stored == (value.encode() if isinstance(value, str) else value):
            return True, current           # the first member had taken our write
        return False, current

    def compare_and_swap_value(self, key: str, value: bytes | str, mod_revision: int,
                               lease=None) -> tuple[bool, bytes | None, int]:
        """Like ``compare_and_swap`` but atomically returns the current value on failure.

        Returns (succeeded, value now stored or None when absent, its mod_revision).
        """
        txn = self._client.transactions
        compare = [txn.version(key) == 0] if mod_revision == 0 else [txn.mod(key) == mod_revision]
        (ok, responses), retried = self._call_tracked(
            self._client.transaction, compare=compare,
            success=[txn.put(key, value, lease=lease)], failure=[txn.get(key)])
        data = value.encode() if isinstance(value, str) else value
        if ok:
            return True, data, responses[0].response_put.header.revision
        for current, meta in responses[0] if responses else []:
            return retried and current == data, current, meta.mod_revision   # retried: ours landed first
        return False, None, 0

    def txn(self, compare: list, success: list, failure: list | None = None) -> Any:
        """One transaction of etcd's own messages (built by ``marind.core.etcd_txn``).

        The library's transaction helpers cannot ask for a count or for keys only, nor
        delete a prefix; those keep a read of N keys from carrying N values. Returns
        etcd's ``TxnResponse``. Fails over like every call (``_call_tracked``), so its
        writes must be idempotent or checked by the caller.
        """
        request = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure or [])

        def send() -> Any:
            try:
                return self._client.kvstub.Txn(request, self.timeout, credentials=self._client.call_credentials,
                                               metadata=self._client.metadata)
            except grpc.RpcError as exc:
                self._client._manage_grpc_errors(exc)   # raises the library's exception for it
                raise
        return self._call(send)

    def delete(self, key: str) -> bool:
        return self._call(self._client.delete, key)

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` iff its mod_revision is still ``mod_revision``; whether it was deleted."""
        txn = self._client.transactions
        (ok, _), retried = self._call_tracked(self._client.transaction, compare=[txn.mod(key) == mod_revision],
                                              success=[txn.delete(key)], failure=[])
        if ok or not retried:
            return bool(ok)
        return self.get(key)[1] == 0        # retried: the first member had deleted it

    def delete_prefix(self, prefix: str) -> None:
        self._call(self._client.delete_prefix, prefix)

    # -- leases -------------------------------------------------------------------------
    def revision(self) -> int:
        """etcd's revision now."""
        return int(self._call(self._client.get_response, self.prefix + "/").header.revision)

    def compact(self, revision: int) -> bool:
        """Drop the history before ``revision``; False when etcd was compacted that far already."""
        try:
            self._call(self._client.compact, revision)
        except ControlPlaneRefused as exc:
            if "compacted" not in str(exc):
                raise
            return False
        return True

    def lease(self, ttl: int):
        return self._call(self._client.lease, ttl)

    def refresh_lease(self, lease) -> int:
        """Keep a lease alive; returns the remaining TTL (<= 0 if it expired)."""
        responses = self._call(lambda: list(self._client.refresh_lease(lease.id)))
        return responses[0].TTL if responses else 0

    def revoke_lease(self, lease) -> None:
        self._call(self._client.revoke_lease, lease.id)

    def lease_of(self, key: str) -> int | None:
        """The id of the lease ``key`` is attached to; None when the key is absent or has none."""
        _value, meta = self._call(self._client.get, key)
        lease_id = getattr(meta, "lease_id", 0) if meta is not None else 0
        return int(lease_id) or None

    def lease_time_to_live(self, lease_id: int) -> tuple[int, int] | None:
        """(remaining, granted) TTL of a lease in whole seconds (etcd truncates the remaining
        time: the lease has less than ``remaining + 1`` s left); None when it is gone."""
        resp = self._call(self._client.get_lease_info, lease_id)
        if resp.TTL < 0:
            return None
        return int(resp.TTL), int(resp.grantedTTL)

    def revoke_lease_id(self, lease_id: int) -> bool:
        """Revoke another holder's lease (its keys go with it); False when it was gone already."""
        def revoke() -> bool:
            try:
                self._client.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return False
                raise
            return True
        return bool(self._call(revoke))

    # -- watches ------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: Callable[[Any], None],
                     start_revision: int | None = None, *, deletes_only: bool = False) -> int:
        """Call ``callback(response)`` for changes under ``prefix``; returns a watch id.

        ``deletes_only``: etcd sends deletes alone (no puts), each with the key's last value
        (``event.prev_value``, ``prev_create_revision``).
        """
        kwargs: dict[str, Any] = {"start_revision": start_revision} if start_revision else {}
        if deletes_only:
            kwargs.update(filters=[etcdrpc.WatchCreateRequest.NOPUT], prev_kv=True)
        return self._call(self._client.add_watch_prefix_callback, prefix, callback, **kwargs)

    def cancel_watch(self, watch_id: int) -> None:
        try:
            self._client.cancel_watch(watch_id)
        except _TRANSIENT:
            pass

    def watch_prefix_iter(self, prefix: str) -> tuple[Iterator, Callable[[], None]]:
        """(events iterator, cancel) for a prefix."""
        return self._call(self._client.watch_prefix, prefix)

    # -- locks / health -----------------------------------------------------------------
    def lock(self, name: str, ttl: int = 10):
        return self._client.lock(self.key("locks", name), ttl=ttl)

    def ping(self) -> None:
        """Raise ControlPlaneUnavailable unless a member answers."""
        self._call(self._client.status)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead channel is not an error
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

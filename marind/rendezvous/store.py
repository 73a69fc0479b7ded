"""A c10d ``Store`` on etcd v3, for torch elastic agents.

torchrun's agents use the rendezvous store after each round: rank 0
publishes ``MASTER_ADDR``/``MASTER_PORT`` for the workers' own TCPStore,
rank 0 assigns worker ranks (``multi_get``/``multi_set``), and all agents
meet at the exit barrier (``add``/``wait``). torch's c10d backend keeps
this store in a TCPStore hosted by the node whose address is the
rendezvous endpoint, so losing that node loses the store and ends the job.
Here the endpoint is etcd itself, which every agent already relies on, so
the store lives there too: no node is special and any node can be lost.

Keys are the c10d keys verbatim under ``{prefix}/jobs/{run_id}/rdzv/store/``;
values are raw bytes. ``get``/``wait`` block by watch, up to the store's
timeout, and then raise ``DistStoreError`` whose message says "timeout", as
c10d's own stores do. The store passes torch's own store tests
(``StoreTestBase`` of ``test/distributed/test_store.py``) alone and wrapped
in a ``PrefixStore``: c10d calls a Python store's ``num_keys``/``delete_key``
by their C++ names ``getNumKeys``/``deleteKey``, so those are aliases, and
``clone()`` gives a store on the same client for another thread. Every etcd
call is retried through an outage for ``grace`` seconds
(``--rdzv-conf etcd_grace_timeout``) before ``ControlPlaneUnavailable``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from marind.core.etcd_client import EtcdClient
from marind.core.rdzv_keys import store_base
from marind.rendezvous.retry import DEFAULT_GRACE, with_grace

_ROUND_PREFIX = "torch.rendezvous."



def _as_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, bytearray)):
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, not {type(value).__name__}")


class _GraceClient:
    """The store's view of an EtcdClient: each call retried through an outage."""

    def __init__(self, client: EtcdClient, grace: float) -> None:
        self._client, self._grace = client, grace

    def key(self, *parts: str) -> str:
        return self._client.key(*parts)

    def __getattr__(self, name: str):
        fn = getattr(self._client, name)
        return lambda *args, **kwargs: with_grace(lambda: fn(*args, **kwargs), self._grace,
                                                  f"rdzv store {name}")


class Etcd3Store(dist.Store):
    """set/get/add/compare_set/wait/check/num_keys/delete_key on etcd v3 keys.

    Keys may be ``str`` or ``bytes``; values ``str``, ``bytes`` or a list of byte values.
    Every etcd call is retried through an outage of up to ``grace`` seconds, then
    raises ``ControlPlaneUnavailable``.

    Args:
        client: the etcd client (its prefix applies).
        run_id: the rendezvous (job) id: keys live under ``store_base(client, run_id)``.
        timeout: how long ``get``/``wait`` block (default: c10d's ``Store`` default).
        grace: seconds an etcd outage is retried.
    """

    #: how long ``get``/``wait`` block: c10d's ``Store.timeout`` (set by ``set_timeout``)
    timeout: timedelta

    def __init__(self, client: EtcdClient, run_id: str, timeout: timedelta | None = None,
                 grace: float = DEFAULT_GRACE) -> None:
        super().__init__()  # required by the pybind trampoline
        self._etcd, self._grace = client, grace
        self._clones: list[Etcd3Store] = []
        self._client = _GraceClient(client, grace)
        self._run_id = run_id
        self._base = store_base(client, run_id)
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key) -> str:
        return self._base + (key.decode() if isinstance(key, bytes) else key)

    def set(self, key, value) -> None:
        """Write ``value`` at ``key``."""
        self._client.put(self._key(key), _as_bytes(value))

    def get(self, key) -> bytes:
        """The value at ``key``, waiting (by watch) up to the store's timeout for it to be set.

        Raises:
            DistStoreError: not set within the timeout.
        """
        value = self._client.wait_for_key(self._key(key), self.timeout.total_seconds())
        if value is None:
            raise dist.DistStoreError(
                f"timeout after {self.timeout.total_seconds():g}s: key {key!r} not set in etcd ({self._base})")
        return value

    def add(self, key, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent: 0), atomically; the new value."""
        full = self._key(key)
        while True:
            value, mod_revision = self._client.get(full)
            current = int(value) if value else 0
            ok, _ = self._client.compare_and_swap(full, str(current + amount), mod_revision)
            if ok:
                return current + amount

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        """TCPStore's semantics: set if the value equals ``expected`` (absent counts as b"")."""
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            value, mod_revision = self._client.get(full)
            if value is None and expected:
                return expected
            if value is not None and value != expected:
                return value
            ok, _ = self._client.compare_and_swap(full, desired, mod_revision)
            if ok:
                return desired

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        """Block until every key is set, ``timeout`` (default the store's) for all together.

        Raises:
            DistStoreError: a key still unset when the time is up.
        """
        budget = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + budget
        for key in keys:
            remaining = max(0.0, deadline - time.monotonic())
            if self._client.wait_for_key(self._key(key), remaining) is None:
                raise dist.DistStoreError(
                    f"timeout after {budget:g}s waiting for key {key!r} in etcd ({self._base})")

    def check(self, keys) -> bool:
        """Whether every key is set (no waiting)."""
        return all(self._client.get(self._key(key))[0] is not None for key in keys)

    def num_keys(self) -> int:
        """How many keys this rendezvous' store holds."""
        return self._client.count_prefix(self._base)

    def delete_key(self, key) -> bool:
        """Delete ``key``; whether it existed."""
        return bool(self._client.delete(self._key(key)))

    # c10d's trampoline for Python stores looks these up by their C++ names when the store is
    # reached through another store (PrefixStore, as torch elastic wraps it every round).
    def getNumKeys(self) -> int:
        """``num_keys`` under the name c10d calls."""
        return self.num_keys()

    def deleteKey(self, key) -> bool:
        """``delete_key`` under the name c10d calls."""
        return self.delete_key(key)

    def clone(self) -> Etcd3Store:
        """Another store on the same keys, for use from another thread.

        It shares this store's etcd client (its gRPC channel is thread-safe), timeout and
        outage grace. This store keeps a reference to the clone: when c10d clones through
        a ``PrefixStore`` it holds only the C++ half, and a Python store whose Python object
        is gone can no longer be called.
        """
        clone = Etcd3Store(self._etcd, self._run_id, timeout=self.timeout, grace=self._grace)
        self._clones.append(clone)
        return clone

    def delete_rounds_before(self, round_: int) -> int:
        """Drop the keys of rendezvous rounds older than ``round_``; returns how many rounds."""
        head = f"{self._base}{_ROUND_PREFIX}{self._run_id}."
        stale = set()
        for key, _, _ in self._client.get_prefix(head):
            number = key[len(head):].split("/", 1)[0]
            if number.isdigit() and int(number) < round_:
                stale.add(number)
        for number in stale:
            self._client.delete_prefix(f"{head}{number}/")
        return len(stale)

"""Parts of an etcd transaction for ``EtcdClient.txn``: compares, ops, and reading the answer.

The etcd3 library's transaction helpers read whole values only. The
rendezvous (``marind.rendezvous.rounds``) asks etcd for counts and key
names inside one transaction, so that what a node reads does not grow with
the number of nodes; these build etcd's own messages for that.
"""

from __future__ import annotations

from typing import Any

from etcd3 import etcdrpc


def _b(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def prefix_end(prefix: str) -> bytes:
    """The range end that makes ``prefix`` a prefix range (etcd's rule: last byte + 1)."""
    raw = bytearray(_b(prefix))
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def absent(key: str) -> Any:
    """Compare: ``key`` does not exist (its version is 0)."""
    return etcdrpc.Compare(key=_b(key), target=etcdrpc.Compare.VERSION,
                           result=etcdrpc.Compare.EQUAL, version=0)


def equals(key: str, value: str | bytes) -> Any:
    """Compare: ``key`` holds exactly ``value``."""
    return etcdrpc.Compare(key=_b(key), target=etcdrpc.Compare.VALUE,
                           result=etcdrpc.Compare.EQUAL, value=_b(value))


def lease_is(key: str, lease_id: int) -> Any:
    """Compare: ``key`` is attached to the lease ``lease_id`` (false when it is absent)."""
    return etcdrpc.Compare(key=_b(key), target=etcdrpc.Compare.LEASE, result=etcdrpc.Compare.EQUAL,
                           lease=lease_id)


def created_before(prefix: str, revision: int) -> Any:
    """Compare: every key under ``prefix`` was created before ``revision`` (none since; true when
    there is none). Nothing under ``prefix`` is sent back."""
    return etcdrpc.Compare(key=_b(prefix), range_end=prefix_end(prefix), target=etcdrpc.Compare.CREATE,
                           result=etcdrpc.Compare.LESS, create_revision=revision)


def put(key: str, value: str | bytes, lease_id: int = 0, *, prev_kv: bool = False) -> Any:
    """Op: put ``value`` at ``key`` (under ``lease_id`` when not 0); with ``prev_kv`` the answer
    carries the key as it was before (``prev_version_of``)."""
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=_b(key), value=_b(value), lease=lease_id,
                                                            prev_kv=prev_kv))


def delete(key: str) -> Any:
    """Op: delete ``key``."""
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=_b(key)))


def delete_range(start: str, end: str) -> Any:
    """Op: delete every key from ``start`` up to, not including, ``end`` (byte order)."""
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=_b(start), range_end=_b(end)))


def delete_prefix(prefix: str) -> Any:
    """Op: delete every key under ``prefix``."""
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
        key=_b(prefix), range_end=prefix_end(prefix)))


def get(key: str) -> Any:
    """Op: read ``key`` (value and revisions)."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=_b(key)))


def count(key: str, prefix: bool = False) -> Any:
    """Op: how many keys are ``key`` (0 or 1) or, with ``prefix``, under it; no key is sent back."""
    request = etcdrpc.RangeRequest(key=_b(key), count_only=True)
    if prefix:
        request.range_end = prefix_end(key)
    return etcdrpc.RequestOp(request_range=request)


def keys(prefix: str) -> Any:
    """Op: the keys under ``prefix`` with their revisions, without values."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=_b(prefix), range_end=prefix_end(prefix), keys_only=True))


def values(prefix: str, created_after: int = 0) -> Any:
    """Op: the keys under ``prefix`` with their values; with ``created_after``, only the keys
    created at a later revision (etcd filters them; it still reads the range)."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=_b(prefix), range_end=prefix_end(prefix), min_create_revision=created_after + 1 if created_after else 0))


def nested(compare: list, success: list, failure: list | None = None) -> Any:
    """Op: a transaction inside a transaction (etcd 3.3+), for a write with a condition of its own."""
    return etcdrpc.RequestOp(request_txn=etcdrpc.TxnRequest(compare=compare, success=success,
                                                             failure=failure or []))


def value_of(response: Any, index: int) -> bytes | None:
    """The value a ``get`` at ``index`` of the answer read, or None when the key is absent."""
    kvs = response.responses[index].response_range.kvs
    return bytes(kvs[0].value) if kvs else None


def count_of(response: Any, index: int) -> int:
    """The count a ``count``, ``keys`` or ``get`` at ``index`` of the answer read."""
    return int(response.responses[index].response_range.count)


def keys_of(response: Any, index: int) -> list[tuple[str, int]]:
    """``(key, create_revision)`` of each key a ``keys`` at ``index`` of the answer read."""
    return [(kv.key.decode(), int(kv.create_revision))
            for kv in response.responses[index].response_range.kvs]


def values_of(response: Any, index: int) -> list[tuple[str, bytes]]:
    """``(key, value)`` of each key a ``values`` (or ``get``) at ``index`` of the answer read."""
    return [(kv.key.decode(), bytes(kv.value)) for kv in response.responses[index].response_range.kvs]


def created_values_of(response: Any, index: int) -> list[tuple[str, bytes, int]]:
    """``(key, value, create_revision)`` of each key a ``values`` at ``index`` of the answer read."""
    return [(kv.key.decode(), bytes(kv.value), int(kv.create_revision))
            for kv in response.responses[index].response_range.kvs]


def prev_version_of(response: Any, index: int) -> int:
    """How many times the key of a ``put(..., prev_kv=True)`` at ``index`` had been written before
    it (its ``version``; 0: it did not exist). Distinct for every put of the key, as etcd applies
    them one by one: a counter taken without a compare."""
    prev = response.responses[index].response_put
    return int(prev.prev_kv.version) if prev.HasField("prev_kv") else 0

"""The memory tier's storage backend (``peermem://DIR``): this node's memory, a peer's copy.

A store root here is one node's directory in host memory (a tmpfs such as /dev/shm,
``DirStore``) plus the transfer servers of the world's other nodes (``storage_options``:
``{"nodes": [[addr, port], ...], "node": i}``, ``ring`` numbering). Every object a rank
writes goes to its own node's memory and, over the data network, to the next node of the
ring (``ring.replica_target``), and ``write`` returns only once both hold it; so a rank's
done marker, written after its objects, says that its part is replicated, and rank 0's
commit (all markers present, under the fence) commits a step whose every part is on two
nodes. JSON objects (markers, object lists, the manifest) go to every node: any survivor
sees which steps were committed, and which of them it can no longer complete.

Reads look in this node's memory first, then ask the other nodes in ring order; listings
are the union over the nodes. Only the nodes of the *current* world are asked: a lost
node is never waited on. Nothing here is durable (a power cut loses the node's memory):
``make_durable`` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ckpt_store.memory.dir_store import DirStore
from ckpt_store.memory.ring import replica_target
from ckpt_store.memory.wire import RemoteNode
from ckpt_store.storage.base import StorageBase, json_bytes, run_all

SCHEME = "peermem"


class _NoFs:
    """``Storage.fs`` for tools: this backend has no fsspec filesystem."""

    protocol = SCHEME


class PeerMemoryStorage(StorageBase):
    """One node's memory checkpoints and its peers' (see the module docstring and ``storage.Storage``).

    Args:
        url: ``peermem://`` + this node's directory.
        root: that directory.
        nodes: the world's nodes' transfer servers, ``[addr, port]`` in ring order.
        node: this node's index in ``nodes`` (its own server is never asked: its memory is read directly).
        io_threads: concurrent requests.
        timeout_s: a peer silent for this long fails the request.
    """

    local = False

    def __init__(self, url: str, root: str, nodes: list, node: int, io_threads: int = 4,
                 timeout_s: float = 30.0):
        super().__init__(url, _NoFs(), root, io_threads, None)
        self.s3 = self.in_process = False
        self.mem = DirStore(root)
        self.node = int(node)
        self.peers: dict[int, RemoteNode] = {i: RemoteNode(a, p, timeout_s) for i, (a, p) in enumerate(nodes)
                                             if i != self.node}
        target = replica_target(self.node, len(nodes)) if nodes else None
        self.replica: RemoteNode | None = self.peers.get(target) if target is not None else None
        n = max(1, len(nodes))
        self._order = [self.peers[(self.node + k) % n] for k in range(1, n) if (self.node + k) % n in self.peers]

    # -- writes --------------------------------------------------------------------------
    def write(self, key: str, pieces: list, crc: int | None = None) -> None:
        """Write one object to this node's memory and to the replica node's; returns once both hold it."""
        if self.replica is not None:
            self.replica.request({"op": "put", "key": key}, pieces)
        self.mem.write(key, pieces)

    def write_json_atomic(self, key: str, obj: Any) -> None:
        """Write ``obj`` as JSON to every node (each sees it whole or not at all)."""
        data = json_bytes(obj)
        for fut in [self._pool.submit(p.request, {"op": "put", "key": key}, [data]) for p in self._order]:
            fut.result()
        self.mem.write(key, [data])

    def make_durable(self, keys: list[str]) -> None:
        """Nothing: host memory is not durable (that is what the durable store is for)."""

    # -- reads ---------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object ``key``, from the first node that holds it."""
        if self.mem.exists(key):
            try:
                return self.mem.read_range(key)
            except FileNotFoundError:
                pass
        for peer in self._order:
            answer, data = peer.request({"op": "get", "key": key, "start": 0, "end": None})
            if answer.get("ok"):
                return data
        raise FileNotFoundError(f"{self.url}/{key}")

    def _read_one(self, key: str, start: int, bufs: list) -> int:
        if self.mem.exists(key):
            try:
                return self.mem.read_into(key, start, bufs)
            except FileNotFoundError:
                pass
        end = start + sum(memoryview(b).nbytes for b in bufs)
        for peer in self._order:
            answer, n = peer.request({"op": "get", "key": key, "start": start, "end": end}, into=bufs)
            if answer.get("ok"):
                return n
        raise FileNotFoundError(f"{self.url}/{key}")

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of each key; short at the end of an object."""
        def one(_i: int, r: tuple[str, int, int]) -> bytes:
            buf = bytearray(max(0, r[2] - r[1]))
            n = self._read_one(r[0], r[1], [buf])
            return bytes(buf[:n])

        return run_all(self._pool, one, ranges)

    def read_into(self, reqs: Iterable[tuple[str, int, list]],
                  done: Callable[[int, int], None] | None = None) -> list[int]:
        """Fill each request's buffers in order (this node's memory first, else a peer's);
        ``done(i, n)`` in the I/O thread as soon as request ``i`` is read."""
        def one(i: int, req: tuple[str, int, list]) -> int:
            n = self._read_one(*req)
            if done is not None:
                done(i, n)
            return n

        return run_all(self._pool, one, reqs)

    def exists(self, key: str) -> bool:
        if self.mem.exists(key):
            return True
        return any(p.request({"op": "exists", "key": key})[0].get("exists") for p in self._order)

    def size(self, key: str) -> int:
        if self.mem.exists(key):
            return self.mem.size(key)
        for peer in self._order:
            sizes = peer.request({"op": "sizes", "key": key.rsplit("/", 1)[0] if "/" in key else ""})[0]
            name = key.rsplit("/", 1)[-1]
            if name in (sizes.get("sizes") or {}):
                return int(sizes["sizes"][name])
        raise FileNotFoundError(f"{self.url}/{key}")

    def object_sizes(self, key: str) -> dict[str, int]:
        """Every object under ``key`` on any node: {key relative to ``key``: size}."""
        out: dict[str, int] = {}
        for peer in reversed(self._order):
            out.update(peer.request({"op": "sizes", "key": key})[0].get("sizes") or {})
        out.update(self.mem.sizes(key))
        return out

    def list_dir(self, key: str = "") -> list[str]:
        """The entries directly under ``key`` on any node, sorted."""
        names = set(self.mem.list_dir(key))
        for peer in self._order:
            names.update(peer.request({"op": "list", "key": key})[0].get("names") or [])
        return sorted(names)

    def rename(self, key: str, new_key: str) -> None:
        """Rename on every node that holds ``key`` (not atomic across nodes)."""
        self.mem.rename(key, new_key)
        for peer in self._order:
            peer.request({"op": "rename", "key": key, "new": new_key})

    def delete_prefix(self, key: str) -> None:
        """Delete the object or everything under ``key`` on every node."""
        for peer in self._order:
            peer.request({"op": "delete", "key": key})
        self.mem.delete(key)

    def close(self) -> None:
        super().close()
        for peer in self.peers.values():
            peer.close()


def open_peer_memory(url: str, storage_options: dict | None, io_threads: int = 4) -> PeerMemoryStorage:
    """The backend of a ``peermem://DIR`` URL (``storage_options``: ``nodes``, ``node``, ``timeout_s``).

    Raises:
        ValueError: the URL or the options are malformed.
    """
    root = url.split("://", 1)[1]
    opts = dict(storage_options or {})
    if not root.startswith("/"):
        raise ValueError(f"{url!r}: a peermem:// URL names an absolute directory (peermem:///dev/shm/...)")
    nodes = opts.get("nodes") or []
    node = int(opts.get("node", 0))
    if nodes and not 0 <= node < len(nodes):
        raise ValueError(f"peermem storage option node={node} is not one of {len(nodes)} nodes")
    return PeerMemoryStorage(url, root.rstrip("/") or "/", nodes, node, io_threads,
                             float(opts.get("timeout_s", 30.0)))

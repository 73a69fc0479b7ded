"""The peermem:// storage backend against real transfer servers (one process per node)."""

from __future__ import annotations

import os

import pytest

from ckpt_store.memory.peer_storage import PeerMemoryStorage
from ckpt_store.memory.server import start_server, stop_server
from ckpt_store.memory.wire import PeerError
from ckpt_store.storage.protocol import open_storage


@pytest.fixture
def three_nodes(tmp_path):
    """Three nodes' directories, each with its transfer server; stopped at the end."""
    dirs = [str(tmp_path / f"h{i}") for i in range(3)]
    servers = []
    try:
        for d in dirs:
            servers.append(start_server(d, "127.0.0.1"))
        yield dirs, servers
    finally:
        for proc, _ in servers:
            stop_server(proc)


def _storage(dirs, servers, node, timeout_s=30.0) -> PeerMemoryStorage:
    st = open_storage(f"peermem://{dirs[node]}",
                      {"nodes": [["127.0.0.1", port] for _, port in servers], "node": node, "timeout_s": timeout_s})
    assert isinstance(st, PeerMemoryStorage)
    return st


def test_a_write_lands_in_own_memory_and_the_next_nodes_only(three_nodes):
    dirs, servers = three_nodes
    st = _storage(dirs, servers, 2)
    st.write("step-1/a/c0", [b"abc", b"def"])
    assert open(os.path.join(dirs[2], "step-1/a/c0"), "rb").read() == b"abcdef"
    assert open(os.path.join(dirs[0], "step-1/a/c0"), "rb").read() == b"abcdef"   # 2's replica is on 0
    assert not os.path.exists(os.path.join(dirs[1], "step-1/a/c0"))
    st.write_json_atomic("step-1/.marind/rank-0.json", {"rank": 0})
    assert all(os.path.exists(os.path.join(d, "step-1/.marind/rank-0.json")) for d in dirs)
    st.close()


def test_reads_find_an_object_on_any_live_node(three_nodes):
    dirs, servers = three_nodes
    writer = _storage(dirs, servers, 0)
    writer.write("s/x", [bytes(range(200))])            # on nodes 0 and 1
    writer.close()
    reader = _storage(dirs, servers, 2)                  # holds nothing of it
    assert reader.read("s/x") == bytes(range(200))
    assert reader.read_ranges([("s/x", 10, 20), ("s/x", 190, 400)]) == [bytes(range(10, 20)), bytes(range(190, 200))]
    a, b = bytearray(5), bytearray(7)
    got = []
    assert reader.read_into([("s/x", 3, [a, b])], done=lambda i, n: got.append((i, n))) == [12]
    assert bytes(a + b) == bytes(range(3, 15)) and got == [(0, 12)]
    assert reader.exists("s/x") and not reader.exists("s/y")
    assert reader.size("s/x") == 200
    assert reader.object_sizes("s") == {"x": 200}
    assert reader.list_dir("") == ["s"]
    with pytest.raises(FileNotFoundError):
        reader.read("s/y")
    reader.delete_prefix("s")
    assert not any(os.path.exists(os.path.join(d, "s/x")) for d in dirs)
    reader.close()


def test_a_write_whose_replica_cannot_land_fails_and_leaves_no_own_copy(three_nodes, tmp_path):
    dirs, servers = three_nodes
    st = _storage(dirs, servers, 0, timeout_s=5.0)
    stop_server(servers[1][0])                           # node 0's replica node is gone
    with pytest.raises(PeerError, match="unreachable|failed put"):
        st.write("s/x", [b"data"])
    assert not os.path.exists(os.path.join(dirs[0], "s/x"))
    st.close()


def test_keys_cannot_leave_the_nodes_directory(three_nodes):
    dirs, servers = three_nodes
    st = _storage(dirs, servers, 0)
    with pytest.raises((ValueError, PeerError), match="bad object key"):
        st.write("../escape", [b"x"])
    with pytest.raises(PeerError, match="bad object key"):
        _storage(dirs, servers, 2).write_json_atomic("../../escape", {})
    st.close()


def test_a_relative_peermem_url_is_refused():
    with pytest.raises(ValueError, match="absolute directory"):
        open_storage("peermem://relative/dir", {"nodes": [], "node": 0})

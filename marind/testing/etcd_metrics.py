"""etcd's own counters, read from its ``/metrics``: what a test or a bench counts a workload by.

``etcd_counters(endpoint)``: requests (gRPC messages etcd received from clients), writes (puts
and deletes), WAL bytes, client bytes in and out, and the database's size. Counting from the
server side sees every client alike (agents, torchruns, the CLI) and costs the count itself one
HTTP request, which etcd does not count as a gRPC message.
"""

from __future__ import annotations

import urllib.request

_NAMES = {"etcd_mvcc_put_total": "writes", "etcd_mvcc_delete_total": "writes",
          "etcd_disk_wal_write_bytes_total": "wal_bytes",
          "etcd_network_client_grpc_received_bytes_total": "bytes_in",
          "etcd_network_client_grpc_sent_bytes_total": "bytes_out",
          "etcd_mvcc_db_total_size_in_bytes": "db_bytes",
          "etcd_mvcc_db_total_size_in_use_in_bytes": "db_in_use_bytes"}


def etcd_counters(endpoint: str) -> dict[str, float]:
    """etcd's counters: requests, writes, wal_bytes, bytes_in, bytes_out, db_bytes and db_in_use_bytes
    (gauges: the database file, and the part of it holding data), and
    ``requests:{Method}`` for each gRPC method (``Range``, ``Txn``, ``Put``, ``LeaseKeepAlive``, ...).

    Args:
        endpoint: the member's client URL (``http://host:port``).

    Returns:
        The figures by name.
    """
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=30).read().decode()
    out = dict.fromkeys(("requests", "writes", "wal_bytes", "bytes_in", "bytes_out", "db_bytes", "db_in_use_bytes"), 0.0)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("grpc_server_msg_received_total{") and 'grpc_service="etcdserverpb.' in name:
            out["requests"] += float(value)
            method = name.split('grpc_method="', 1)[1].split('"', 1)[0] if 'grpc_method="' in name else "?"
            out[f"requests:{method}"] = out.get(f"requests:{method}", 0.0) + float(value)
        elif name in _NAMES:
            out[_NAMES[name]] += float(value)
    return out

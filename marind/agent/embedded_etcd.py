"""`marind agent --embedded`: a single-node etcd the agent starts (or adopts) under its state dir.

The ports are chosen once and kept in ``{state_dir}/etcd/ports.json``, so a
restarted agent finds the same etcd; one still listening there (left by a
previous agent) is adopted as it is. The endpoint is written to
``{state_dir}/etcd.endpoint`` for the CLI (``marind.control.config.endpoint_file``).
"""

from __future__ import annotations

import json
from pathlib import Path

from marind.control.config import endpoint_file
from marind.control.local_etcd import LocalEtcd
from marind.core.log import get_logger
from marind.core.netutil import free_ports, port_open


def start_embedded_etcd(state_dir: str | Path) -> tuple[LocalEtcd | None, str]:
    """Start the node's own etcd, or adopt the one a previous agent left running.

    Args:
        state_dir: the agent's state dir.

    Returns:
        (the server this agent started, or None when it adopted one; the client endpoint).
    """
    log = get_logger(__name__)
    base = Path(state_dir) / "etcd"
    base.mkdir(parents=True, exist_ok=True)
    ports_file = base / "ports.json"
    try:
        ports = json.loads(ports_file.read_text())
    except (OSError, ValueError):
        ports = dict(zip(("client", "peer"), free_ports(2)))
        ports_file.write_text(json.dumps(ports))
    server = LocalEtcd(base / "data", client_port=ports["client"], peer_port=ports["peer"],
                       log_path=base / "etcd.log")
    if port_open("127.0.0.1", ports["client"]):
        log.info("embedded_etcd_adopted", endpoint=server.endpoint)
        endpoint = f"http://127.0.0.1:{ports['client']}"
        endpoint_file(state_dir).write_text(endpoint + "\n")
        return None, endpoint       # left by a previous agent; use it as it is
    server.start()
    endpoint_file(state_dir).write_text(server.endpoint + "\n")
    return server, server.endpoint

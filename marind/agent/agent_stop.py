"""Stopping the agent (SIGTERM or SIGINT, what ``systemctl stop`` sends; docs/design.md §1, *Stopping*).

Every job's torchrun is stopped at once (each up to ``agent.stop_timeout`` for a checkpoint in
flight), the node leaves each job cleanly (its departure marked, so that no agent reports it
lost, and a ``node_left`` event), then the probes, the etcd link and its lease, the metrics
server and an embedded etcd end, in that order.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from marind.agent.run_monitor import RunMonitor
from marind.control.config import AgentConfig


class StoppingAgent(Protocol):
    """What stopping needs of ``marind.agent.daemon.Agent``."""

    config: AgentConfig
    runs: dict[str, RunMonitor]
    notifier: Any
    link: Any
    doctor: Any
    data: Any
    metrics_server: Any
    etcd_server: Any
    log: Any


def stop_agent(agent: StoppingAgent) -> None:
    """Stop ``agent``'s jobs in parallel, leave them cleanly, deregister and close (see the module docstring)."""
    agent.notifier.stopping(f"stopping {len(agent.runs)} job(s)")
    now = time.time()
    for run in agent.runs.values():
        run.settle_hang(now)
    timeout = agent.config.stop_timeout
    threads = [threading.Thread(target=run.stop, args=(timeout,)) for run in agent.runs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)
    link = agent.link
    for job, run in list(agent.runs.items()):
        if run.ft is not None:
            run.ft.stop()
        if link is not None:
            link.outbox.leaving(job, run.members, "agent stopping")
            link.outbox.event(job, "node_left", {"reason": "agent stopping"})
    agent.runs.clear()
    for probes in (agent.doctor, agent.data):
        if probes is not None:
            probes.stop()
    if link is not None:
        link.outbox.flush()
        link.watch.stop()
        link.registry.stop(revoke=True)
        link.client.close()
    if agent.metrics_server is not None:
        agent.metrics_server.stop()
    if agent.etcd_server is not None:
        agent.etcd_server.stop()
    agent.log.info("agent_stopped")

"""The agent's data-network prober run alone inside a bed host, for tests/hosts.

    python -m tests.hosts.dataprobe listen
    python -m tests.hosts.dataprobe watch ADDR PORT STOP_FILE [TOKEN]

``listen`` starts a ``DataProber`` and prints its endpoint (one JSON line, with its
token), then sleeps; ``watch`` starts one that probes ``ADDR:PORT`` (expecting the
greeting with ``TOKEN``; without one, any probe listener's) and prints one JSON line
every 0.2 s (``outcome``, ``down_since``, ``link_up``) until ``STOP_FILE`` exists.
"""

from __future__ import annotations

import json
import os
import sys
import time

from marind.agent.liveness.data_probe import DataProber, link_up


def main(argv: list[str]) -> int:
    prober = DataProber().start()
    if argv[0] == "listen":
        print(json.dumps(prober.endpoint()), flush=True)
        while True:
            time.sleep(1)
    addr, port, stop = argv[1], int(argv[2]), argv[3]
    prober.want("job", {"peer": (addr, port, argv[4] if len(argv) > 4 else None)})
    while not os.path.exists(stop):
        state = prober.states("job").get("peer")
        if state is not None:
            print(json.dumps({"outcome": state.outcome, "down_since": state.down_since,
                              "link_up": link_up(prober.addr), "addr": prober.addr}), flush=True)
        time.sleep(0.2)
    prober.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

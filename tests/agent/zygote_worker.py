"""A worker for the zygote tests: ``python -m tests.agent.zygote_worker ACTION [ARG]``.

``exit N``: print the pid and rank, exit N. ``sleep``: print the pid, then sleep until signalled
(SIGTERM exits 143 after printing "term"). ``raise``: an uncaught exception.
"""

import os
import signal
import sys
import time

action = sys.argv[1]
if action == "sleep":                # the handler is in place before the pid line says "ready"
    def on_term(*_):
        print("term", flush=True)
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
print(f"pid={os.getpid()} rank={os.environ.get('RANK')} cwd={os.getcwd()} sid={os.getsid(0)}", flush=True)
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise RuntimeError("boom from the worker")
if action == "sleep":
    while True:
        time.sleep(0.1)

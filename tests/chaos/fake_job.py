"""Stand-ins for an agent, its torchrun and the workers, as real processes.

    python -m tests.chaos.fake_job agent  INFO.json NWORKERS
    python -m tests.chaos.fake_job torchrun INFO.json NWORKERS

``agent`` starts a ``torchrun`` child; ``torchrun`` starts NWORKERS
sleeping workers, writes ``{agent_pid, torchrun_pid, workers: [pid...],
started_at}`` to INFO.json, then reaps its workers and appends each one's
exit status (``{pid, returncode}``, negative = killed by that signal) to
INFO.json's sibling ``INFO.exits.jsonl``. Tests write etcd records that
point at these pids, run an injector, and read what happened to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def agent(info: Path, nworkers: int) -> int:
    child = subprocess.Popen([sys.executable, "-m", "tests.chaos.fake_job", "torchrun",
                              str(info), str(nworkers)])
    return child.wait()


def torchrun(info: Path, nworkers: int) -> int:
    workers = [subprocess.Popen(["sleep", "3600"]) for _ in range(nworkers)]
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"agent_pid": os.getppid(), "torchrun_pid": os.getpid(),
                               "workers": [w.pid for w in workers], "started_at": time.time()}))
    os.replace(tmp, info)
    exits = info.with_name(info.stem + ".exits.jsonl")
    pending = list(workers)
    while pending:
        for w in list(pending):
            rc = w.poll()
            if rc is not None:
                pending.remove(w)
                with open(exits, "a") as fh:
                    fh.write(json.dumps({"pid": w.pid, "returncode": rc}) + "\n")
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    role, path, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    sys.exit(agent(path, n) if role == "agent" else torchrun(path, n))

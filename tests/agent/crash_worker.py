"""A job entrypoint that fails the way a missing data file does: `python -m tests.agent.crash_worker run.toml`.

Each rank writes a "restoring" progress record (so the agent sees the round),
waits ``MARIND_TEST_CRASH_AFTER`` seconds (default 1) and raises
``FileNotFoundError`` naming ``[data] path``, as a trainer opening a missing
dataset index would. Nothing of the trainer is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from pathlib import Path


def main(argv: list[str]) -> int:
    spec = tomllib.loads(Path(argv[0]).read_text())
    data = spec.get("data", {}).get("path", "data/example.idx")
    run_dir = os.environ.get("MARIND_RUN_DIR")
    rank = int(os.environ.get("RANK", "0"))
    if run_dir:
        record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "world_size":
                  int(os.environ.get("WORLD_SIZE", "1")), "pid": os.getpid(), "step": 0, "phase": "restoring",
                  "updated_at": time.time()}
        path = Path(run_dir) / "progress" / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    time.sleep(float(os.environ.get("MARIND_TEST_CRASH_AFTER", "1")))
    with open(data, "rb"):          # missing: FileNotFoundError with the path, as a trainer's loader
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The progress record each rank leaves for its local marind agent.

If ``MARIND_RUN_DIR`` is set, every rank atomically rewrites
``$MARIND_RUN_DIR/progress/rank-{global_rank}.json`` (temp file in the
same directory, then ``os.replace``) at start, after every optimizer step
and at the end:

``{"rank", "local_rank", "world_size", "pid", "step", "loss",
"tokens_per_s", "last_checkpoint_step", "phase", "updated_at"}`` with
``phase`` one of ``starting restoring training checkpointing done``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PHASES = ("starting", "restoring", "training", "checkpointing", "done")


class ProgressWriter:
    def __init__(self, rank: int, local_rank: int, world_size: int, run_dir: str | None = None):
        run_dir = run_dir if run_dir is not None else os.environ.get("MARIND_RUN_DIR")
        self.path = Path(run_dir) / "progress" / f"rank-{rank}.json" if run_dir else None
        self.record = {"rank": rank, "local_rank": local_rank, "world_size": world_size, "pid": os.getpid(),
                       "step": 0, "loss": None, "tokens_per_s": None, "last_checkpoint_step": None,
                       "phase": "starting", "updated_at": time.time()}
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def update(self, **fields) -> None:
        if "phase" in fields and fields["phase"] not in PHASES:
            raise ValueError(f"unknown phase {fields['phase']!r}")
        self.record.update(fields)
        self.record["updated_at"] = time.time()
        if not self.path:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path)

"""Step directories under a store root: names, listing, committed steps, retention applied.

Torch-free (the writer process applies retention after it commits).
"""

from __future__ import annotations

from ckpt_store import retention
from marind.log import get_logger

log = get_logger(__name__)
MANIFEST = "manifest.json"


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit() and len(name) == 15:
        return int(name[5:])
    return None


def all_step_dirs(st) -> list[int]:
    return sorted(s for s in map(parse_step_dir, st.list_dir("")) if s is not None)


def committed_steps(st) -> list[int]:
    return [s for s in all_step_dirs(st) if st.exists(f"{step_dir(s)}/{MANIFEST}")]


def apply_retention(st, keep_last: int | None, keep_every: int | None,
                    in_flight: set[int] | None = None) -> list[int]:
    """Delete steps past ``keep_last``/``keep_every`` and uncommitted leftovers; returns them."""
    committed = committed_steps(st)
    doomed = retention.steps_to_delete(committed, keep_last, keep_every)
    doomed += retention.leftovers_to_delete(all_step_dirs(st), committed, in_flight or set())
    for s in doomed:
        d = step_dir(s)
        if st.exists(f"{d}/{MANIFEST}"):
            st.delete_prefix(f"{d}/{MANIFEST}")  # uncommit first
        st.delete_prefix(d)
        log.info("ckpt_deleted", step=s)
    return sorted(doomed)

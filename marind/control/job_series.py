"""A job's curves over its whole run, bounded: ``{p}/jobs/{job}/series`` (docs/design.md §2, §11).

The agent of global rank 0 appends a point per new step (at most one per ``res_s`` seconds);
when the series holds ``MAX_POINTS`` it keeps every other point and doubles ``res_s``, so a
run of any length fits in a few tens of kilobytes and every agent's job page can draw it.
A point is ``[at, step, loss, tokens_per_s, step_time_s]`` (``None`` where unknown).
``append`` and ``halve`` are pure; the readers (``job_history``) only parse.
"""

from __future__ import annotations

from typing import Any

#: Points kept at most; a full series halves its resolution.
MAX_POINTS = 500
#: The first resolution: at most two points a second (the agent reports every ``report_interval``).
FIRST_RES_S = 0.5


def empty() -> dict[str, Any]:
    return {"res_s": FIRST_RES_S, "points": []}


def parse(raw: Any) -> dict[str, Any]:
    """A stored series, or an empty one when it is missing or malformed."""
    if not isinstance(raw, dict) or not isinstance(raw.get("points"), list):
        return empty()
    points = [p for p in raw["points"] if isinstance(p, list) and len(p) == 5]
    try:
        res = float(raw.get("res_s") or FIRST_RES_S)
    except (TypeError, ValueError):
        res = FIRST_RES_S
    return {"res_s": res, "points": points}


def halve(series: dict[str, Any]) -> dict[str, Any]:
    """Every other point (the last one kept) at twice the interval."""
    pts = series["points"]
    kept = pts[::2] if len(pts) % 2 == 1 else pts[1::2]     # the newest point always stays
    return {"res_s": series["res_s"] * 2, "points": kept}


def append(series: dict[str, Any], at: float, step: int, loss: float | None, tokens_per_s: float | None,
           max_points: int = MAX_POINTS) -> tuple[dict[str, Any], bool]:
    """``series`` with the point of ``step`` at ``at``, and whether it changed.

    A point is added when the step moved (a rollback counts) and ``res_s`` went by since the
    last point; its step time is the time per step since that point.
    """
    pts = series["points"]
    if pts:
        last_at, last_step = pts[-1][0], pts[-1][1]
        if step == last_step or at - last_at < series["res_s"]:
            return series, False
        step_time = (at - last_at) / (step - last_step) if step > last_step else None
    else:
        step_time = None
    point = [round(at, 3), int(step), loss, None if tokens_per_s is None else round(tokens_per_s, 3),
             None if step_time is None else round(step_time, 4)]
    out = {"res_s": series["res_s"], "points": [*pts, point]}
    while len(out["points"]) > max_points:
        out = halve(out)
    return out, True

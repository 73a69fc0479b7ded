"""Small SVG charts of the job page, written here (no script or font from anywhere): pure functions.

Every chart of one job shares one time axis ``[x0, x1]`` (the job's start to its end or now),
so a restart drawn on the timeline lines up with the dip in the curves above it.
"""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT, PAD_L, PAD_R, PAD_B = 760, 130, 58, 10, 18

#: Colours of the ledger's causes (training first: the goodput).
CAUSE_COLOURS = {"training": "#2e7d32", "checkpoint": "#66bb6a", "waiting": "#9e9e9e", "rendezvous": "#8d6e63",
                 "startup": "#90a4ae", "restart": "#ef6c00", "restore": "#ffa726", "recompute": "#fdd835",
                 "detection": "#c62828", "hang": "#6a1b9a", "shutdown": "#bdbdbd"}
#: Event kinds drawn on the timeline, with their colour.
EVENT_COLOURS = {"restart": "#c62828", "node_lost": "#ef6c00", "host_fenced": "#ef6c00", "node_left": "#8d6e63",
                 "hang_detected": "#6a1b9a", "checkpoint_committed": "#2e7d32", "node_joined": "#1565c0",
                 "node_rejoined": "#1565c0", "succeeded": "#2e7d32", "failed": "#c62828", "cancelled": "#616161",
                 "group_failed": "#c62828", "submitted": "#9e9e9e"}


def _x(t: float, x0: float, x1: float) -> float:
    span = max(x1 - x0, 1e-9)
    return PAD_L + (WIDTH - PAD_L - PAD_R) * min(max((t - x0) / span, 0.0), 1.0)


def _num(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e3:
        return f"{v / 1e3:.1f}k"
    if a >= 10 or v == 0:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _offset(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s}s" if s < 120 else (f"{s // 60}m" if s < 7200 else f"{s // 3600}h{(s % 3600) // 60:02d}")


def _time_axis(x0: float, x1: float, y: float) -> str:
    out = [f'<line x1="{PAD_L}" y1="{y}" x2="{WIDTH - PAD_R}" y2="{y}" stroke="#999"/>']
    for i in range(5):
        t = x0 + (x1 - x0) * i / 4
        anchor = "start" if i == 0 else ("end" if i == 4 else "middle")
        out.append(f'<text x="{_x(t, x0, x1):.1f}" y="{y + 13}" text-anchor="{anchor}" class="ax">'
                   f'+{_offset(t - x0)}</text>')
    return "".join(out)


def line_chart(points: list[tuple[float, float]], x0: float, x1: float, *, label: str,
               marks: list[float] | None = None) -> str:
    """A curve of ``(time, value)`` points over ``[x0, x1]``, with dashed lines at ``marks`` (restarts).

    The ``<svg>`` carries ``data-points`` (how many points it drew) and the chart's label.
    """
    head = (f'<svg class="chart" data-label="{escape(label)}" data-points="{len(points)}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">'
            f'<title>{escape(label)}</title><text x="{PAD_L}" y="11" class="lbl">{escape(label)}</text>')
    base = HEIGHT - PAD_B
    body = [_time_axis(x0, x1, base)]
    for t in marks or []:
        xm = _x(t, x0, x1)
        body.append(f'<line class="mark" x1="{xm:.1f}" y1="14" x2="{xm:.1f}" y2="{base}" stroke="#c62828" '
                    'stroke-dasharray="3,3"/>')
    if not points:
        body.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="ax">no data yet</text>')
        return head + "".join(body) + "</svg>"
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1
    top = 16

    def y(v: float) -> float:
        return base - 2 - (base - 2 - top) * (v - lo) / (hi - lo)

    coords = " ".join(f"{_x(t, x0, x1):.1f},{y(v):.1f}" for t, v in points)
    body.append(f'<text x="{PAD_L - 4}" y="{top + 4}" text-anchor="end" class="ax">{_num(hi)}</text>'
                f'<text x="{PAD_L - 4}" y="{base - 2}" text-anchor="end" class="ax">{_num(lo)}</text>')
    body.append(f'<polyline class="curve" fill="none" stroke="#1565c0" stroke-width="1.5" points="{coords}"/>')
    if len(points) == 1:
        t, v = points[0]
        body.append(f'<circle cx="{_x(t, x0, x1):.1f}" cy="{y(v):.1f}" r="2.5" fill="#1565c0"/>')
    return head + "".join(body) + "</svg>"


def timeline(events: list[dict], x0: float, x1: float) -> str:
    """The job's events on the charts' time axis: one marker per event, its details as a tooltip.

    A checkpoint is a bar as long as its duration, ending at its commit.
    """
    h = 54
    out = [f'<svg class="timeline" data-events="{len(events)}" viewBox="0 0 {WIDTH} {h}" width="{WIDTH}" '
           f'height="{h}" role="img"><title>events</title><text x="{PAD_L}" y="11" class="lbl">events</text>',
           _time_axis(x0, x1, h - PAD_B)]
    for e in events:
        kind = str(e.get("kind"))
        colour = EVENT_COLOURS.get(kind)
        if colour is None or not isinstance(e.get("at"), (int, float)):
            continue
        x = _x(float(e["at"]), x0, x1)
        tip = escape(f"+{_offset(float(e['at']) - x0)} {kind} on {e.get('node')}: {describe(e)}")
        detail: dict = e["detail"] if isinstance(e.get("detail"), dict) else {}
        if kind == "checkpoint_committed" and isinstance(detail.get("duration_s"), (int, float)):
            start = _x(float(e["at"]) - float(detail["duration_s"]), x0, x1)
            shape = (f'<rect x="{start:.1f}" y="26" width="{max(x - start, 1.5):.1f}" height="8" '
                     f'fill="{colour}"/>')
        else:
            shape = f'<line x1="{x:.1f}" y1="16" x2="{x:.1f}" y2="{h - PAD_B}" stroke="{colour}" stroke-width="2"/>'
        out.append(f'<g class="ev ev-{escape(kind)}"><title>{tip}</title>{shape}</g>')
    return "".join(out) + "</svg>"


def describe(event: dict) -> str:
    """One event's details in words: the cause of a restart, the node lost, the stack-dump file..."""
    d: dict = event["detail"] if isinstance(event.get("detail"), dict) else {}
    kind = event.get("kind")
    if kind == "checkpoint_committed":
        dur = d.get("duration_s")
        return f"step {d.get('step')}" + (f" in {dur:.1f}s" if isinstance(dur, (int, float)) else "")
    if kind == "hang_detected":
        return f"{d.get('reason', '')}; stacks in {d.get('stack_dump') or '-'}"
    if kind in ("node_lost", "host_fenced"):
        return f"{d.get('node', event.get('node'))}: {d.get('cause') or d.get('reason') or ''} ({d.get('action', '')})"
    parts = [f"{k}={v}" for k, v in d.items() if k != "reason" and not isinstance(v, (dict, list))]
    reason = d.get("reason")
    return (f"{reason}; " if reason else "") + " ".join(parts)


def ledger_bar(ledger: dict) -> str:
    """The ledger as one stacked bar, a segment per cause as wide as its share of the wall time."""
    wall = float(ledger.get("wall_s") or 0.0)
    out = [f'<svg class="ledger-bar" viewBox="0 0 {WIDTH} 22" width="{WIDTH}" height="22" role="img">'
           '<title>where the time went</title>']
    x = float(PAD_L)
    for cause, colour in CAUSE_COLOURS.items():
        s = float((ledger.get("seconds") or {}).get(cause) or 0.0)
        if wall <= 0 or s <= 0:
            continue
        w = (WIDTH - PAD_L - PAD_R) * s / wall
        out.append(f'<rect class="seg seg-{cause}" x="{x:.2f}" y="2" width="{w:.2f}" height="18" fill="{colour}">'
                   f'<title>{cause} {s:.1f}s</title></rect>')
        x += w
    return "".join(out) + "</svg>"

"""The job page's HTML from the documents of ``data`` (pure; no script or font from elsewhere).

A page is a shell around one ``<div id="live">``; its small inline script asks the page's
JSON twin (``/api/cluster``, ``/api/jobs/JOB``) every few seconds for the same part rendered
afresh and swaps it in, so the page follows a running job without a reload. First it lays the
page out and notes when that was done, ``<body data-rendered-ms>`` (``performance.now()``: ms
from the navigation's start to the first render laid out; ``bench/page_bench.py`` reads it).
"""

from __future__ import annotations

import time
from html import escape
from typing import Any
from urllib.parse import quote

from marind.agent.page import svg
from marind.control.goodput_ledger import CAUSES

POLL_MS = 2000

_CSS = """body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}h1{font-size:18px}h2{font-size:15px;
margin:18px 0 6px}table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f4f4f4}.num{text-align:right}.ax{font-size:10px;fill:#666}.lbl{font-size:11px;fill:#333}
.st-RUNNING{color:#1565c0}.st-SUCCEEDED{color:#2e7d32}.st-FAILED{color:#c62828}.st-RESTARTING{color:#ef6c00}
svg{display:block;margin:2px 0}.muted{color:#777}.sw{display:inline-block;width:10px;height:10px;margin-right:4px}"""

_SCRIPT = """(function(){var live=document.getElementById('live');var url=live.dataset.api+location.search;
void live.offsetHeight;document.body.dataset.renderedMs=performance.now().toFixed(1);
function tick(){fetch(url,{cache:'no-store'}).then(function(r){return r.ok?r.json():null}).then(function(d){
if(d&&d.html!==undefined){live.innerHTML=d.html;document.body.dataset.updated=String(d.at);}
}).catch(function(){}).finally(function(){setTimeout(tick,POLL)})}setTimeout(tick,POLL)})();""".replace(
    "POLL", str(POLL_MS))


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return escape(str(v))


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"


def _ago(at: Any, now: float) -> str:
    return "-" if not isinstance(at, (int, float)) else f"{max(now - at, 0):.0f}s ago"


def _table(head: list[str], rows: list[list[str]], cls: str) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def shell(title: str, api: str, live: str) -> str:
    """A whole page: ``live`` in ``#live``, refreshed from ``api``."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{_CSS}</style></head><body data-updated="0"><h1>{escape(title)}</h1>'
            f'<div id="live" data-api="{escape(api)}">{live}</div><script>{_SCRIPT}</script></body></html>')


def cluster_part(doc: dict[str, Any]) -> str:
    """The nodes and the jobs (``data.cluster``)."""
    now = float(doc["at"])
    nodes = [[escape(n["node"]), _fmt(n.get("host")), n.get("state", "-"), _fmt(n.get("slots")),
              ", ".join(_job_link(j) for j in n["jobs"]) or "-",
              "-" if n.get("heartbeat_s") is None else f"{n['heartbeat_s']:.0f}s ago"] for n in doc["nodes"]]
    jobs = [[_job_link(j["id"]), f'<span class="st-{escape(str(j["state"]))}">{escape(str(j["state"]))}</span>',
             _fmt(j.get("reason")), f"{_fmt(j.get('step'))}/{_fmt(j.get('target_steps'))}", _fmt(j.get("restarts")),
             _pct(j.get("goodput")), _fmt(len(j.get("nodes") or [])), _ago(j.get("updated_at"), now)]
            for j in doc["jobs"]]
    return (f'<h2>Nodes ({len(nodes)})</h2>'
            + (_table(["node", "host", "state", "slots", "jobs", "last heartbeat"], nodes, "nodes") if nodes
               else '<p class="muted">No nodes.</p>')
            + f'<h2>Jobs ({len(jobs)})</h2>'
            + (_table(["job", "state", "reason", "step", "restarts", "goodput", "nodes", "updated"], jobs, "jobs")
               if jobs else '<p class="muted">No jobs.</p>'))


def _job_link(job: str) -> str:
    return f'<a href="/jobs/{quote(job)}">{escape(job)}</a>'


def job_part(doc: dict[str, Any]) -> str:
    """One job (``data.job``): its figures, curves, timeline, ledger and checkpoints."""
    j, x0, x1 = doc["job"], float(doc["x0"]), float(doc["x1"])
    points = doc["series"]["points"]
    restarts = [float(e["at"]) for e in doc["events"] if e.get("kind") == "restart"]

    def curve(i: int) -> list[tuple[float, float]]:
        return [(p[0], float(p[i])) for p in points if isinstance(p[i], (int, float))]

    head = (f'<p><b class="st-{escape(str(j["state"]))}">{escape(str(j["state"]))}</b> '
            f'step {_fmt(j.get("step"))}/{_fmt(j.get("target_steps"))}, {_fmt(j.get("restarts"))} restarts, '
            f'goodput <b class="goodput">{_pct(j.get("goodput"))}</b>, nodes {escape(", ".join(j.get("nodes") or []) or "-")}'
            + (f'<br><span class="reason">{escape(str(j["reason"]))}</span>' if j.get("reason") else "") + "</p>")
    charts = "".join(svg.line_chart(curve(i), x0, x1, label=label, marks=restarts)
                     for i, label in ((2, "loss"), (3, "tokens/s"), (4, "step time (s)")))
    return (head + '<h2>Run</h2>' + charts + svg.timeline(doc["events"], x0, x1)
            + '<h2>Where the time went</h2>' + ledger_part(doc["ledger"])
            + '<h2>Events</h2>' + events_part(doc["events"], x0)
            + '<h2>Committed checkpoints</h2>' + checkpoints_part(doc["checkpoints"], x0))


def ledger_part(ledger: dict[str, Any]) -> str:
    """The ledger: its bar and a row per cause (``data-seconds``), then the wall time."""
    wall = float(ledger.get("wall_s") or 0.0)
    rows = []
    for cause in CAUSES:
        s = float((ledger.get("seconds") or {}).get(cause) or 0.0)
        rows.append(f'<tr class="cause" data-cause="{cause}" data-seconds="{s:.3f}"><td>'
                    f'<span class="sw" style="background:{svg.CAUSE_COLOURS[cause]}"></span>{cause}</td>'
                    f'<td class="num">{s:.1f}s</td><td class="num">{(100 * s / wall if wall else 0):.1f}%</td></tr>')
    state = "final" if ledger.get("final") else "so far"
    return (svg.ledger_bar(ledger) + '<table class="ledger"><thead><tr><th>cause</th><th>seconds</th><th>share</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody><tfoot><tr class="wall" data-seconds="{wall:.3f}">'
            f'<th>wall time ({state})</th><th class="num">{wall:.1f}s</th><th class="num">100%</th></tr></tfoot>'
            '</table>')


def events_part(events: list[dict], x0: float) -> str:
    rows = [[f"+{float(e['at']) - x0:.1f}s", _fmt(e.get("node")),
             f'<span class="kind">{escape(str(e.get("kind")))}</span>', escape(svg.describe(e))]
            for e in events if isinstance(e.get("at"), (int, float))]
    return _table(["at", "node", "event", "detail"], rows, "events") if rows else '<p class="muted">No events.</p>'


def checkpoints_part(checkpoints: list[dict], x0: float) -> str:
    rows = [[_fmt(c.get("step")), f"+{float(c['at']) - x0:.1f}s", _fmt(c.get("duration_s")), _fmt(c.get("node")),
             time.strftime("%H:%M:%S", time.localtime(float(c["at"])))] for c in checkpoints]
    return (_table(["step", "at", "duration (s)", "seen by", "time"], rows, "checkpoints") if rows
            else '<p class="muted">None yet.</p>')

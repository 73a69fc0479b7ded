"""The job page's pure parts: the bounded series, the SVG charts, the HTML, the token rules."""

from __future__ import annotations

import re

import pytest

from marind.agent.page import html, svg
from marind.agent.page.server import JobPages, is_loopback, page_token
from marind.control import goodput_ledger as gl
from marind.control import job_series

pytestmark = pytest.mark.unit


def test_the_series_keeps_a_point_per_new_step_and_halves_when_full():
    s = job_series.empty()
    changed_at = []
    for i in range(2000):
        s, changed = job_series.append(s, 1000.0 + i, i, 1.0 / (i + 1), 50.0, max_points=100)
        changed_at.append(changed)
    assert len(s["points"]) <= 100 and s["res_s"] > 1
    assert s["points"][-1][1] >= 1999 - s["res_s"] and s["points"][0][1] == 0          # the whole run, bounded
    assert [p[1] for p in s["points"]] == sorted(p[1] for p in s["points"])
    same, changed = job_series.append(s, 99999.0, s["points"][-1][1], 0.1, 1.0)
    assert not changed and same is s                                       # no new step: no point
    assert job_series.parse({"points": "x"}) == job_series.empty()
    assert job_series.parse({"res_s": 4, "points": [[1, 2, 3, 4, 5], [1]]})["points"] == [[1, 2, 3, 4, 5]]


def test_a_point_carries_its_step_time():
    s, _ = job_series.append(job_series.empty(), 10.0, 5, 0.5, 100.0)
    s, _ = job_series.append(s, 12.0, 9, 0.4, 110.0)
    assert s["points"][-1] == [12.0, 9, 0.4, 110.0, 0.5] and s["points"][0][4] is None


def test_a_chart_draws_its_points_and_the_restart_marks():
    chart = svg.line_chart([(0, 1.0), (5, 0.5), (10, 0.25)], 0, 10, label="loss", marks=[5])
    assert 'data-points="3"' in chart and chart.count('class="mark"') == 1
    coords = re.search(r' points="([^"]+)"', chart).group(1).split()
    xs = [float(c.split(",")[0]) for c in coords]
    assert xs == sorted(xs) and xs[0] == svg.PAD_L and xs[-1] == svg.WIDTH - svg.PAD_R
    assert "no data yet" in svg.line_chart([], 0, 10, label="loss")
    assert "<script" not in chart and "http" not in chart.replace("http://www.w3.org", "")


def test_the_timeline_names_a_restart_its_cause_and_a_hang_its_stack_file():
    events = [{"at": 5.0, "kind": "restart", "node": "a", "detail": {"reason": "worker killed by SIGKILL", "round": 2}},
              {"at": 7.0, "kind": "hang_detected", "node": "a",
               "detail": {"reason": "no step for 60s", "stack_dump": "/x/logs/torchrun.log"}},
              {"at": 9.0, "kind": "checkpoint_committed", "node": "a", "detail": {"step": 4, "duration_s": 1.5}},
              {"at": 9.5, "kind": "something_new", "node": "a", "detail": {}}]
    line = svg.timeline(events, 0, 10)
    assert 'class="ev ev-restart"' in line and "worker killed by SIGKILL" in line
    assert "/x/logs/torchrun.log" in line and "<rect" in line and "something_new" not in line
    table = html.events_part(events, 0)
    assert "+5.0s" in table and "worker killed by SIGKILL" in table and "step 4 in 1.5s" in table


def test_the_ledger_table_adds_up_and_the_pages_escape_what_they_show():
    ledger = gl.compute([{"at": 0, "kind": "node_joined", "seq": 1}, {"at": 9, "kind": "restart", "seq": 2},
                         {"at": 12, "kind": "succeeded", "seq": 3}],
                        [gl.Sample(1, 0, "training", "g"), gl.Sample(8, 7, "training", "g")], now=20)
    part = html.ledger_part(ledger)
    cells = {c: float(v) for c, v in re.findall(r'data-cause="(\w+)" data-seconds="([\d.]+)"', part)}
    wall = float(re.search(r'class="wall" data-seconds="([\d.]+)"', part).group(1))
    assert set(cells) == set(gl.CAUSES) and abs(sum(cells.values()) - wall) < 0.01 and wall == 12
    doc = {"at": 100.0, "nodes": [{"node": "n<1>", "host": "h", "state": "up", "slots": 2, "jobs": ["j&1"],
                                   "heartbeat_s": 1.0}],
           "jobs": [{"id": "j&1", "state": "RUNNING", "reason": "<b>", "step": 3, "target_steps": 10, "restarts": 0,
                     "goodput": 0.5, "nodes": ["n<1>"], "updated_at": 99.0}]}
    page = html.shell("t", "/api/cluster", html.cluster_part(doc))
    assert "n&lt;1&gt;" in page and "&lt;b&gt;" in page and 'href="/jobs/j%261"' in page and "50.0%" in page
    assert "<script>" in page and "src=" not in page


def test_off_loopback_the_page_asks_for_its_token(tmp_path, monkeypatch):
    monkeypatch.delenv("MARIND_PAGE_TOKEN", raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert page_token("127.0.0.1", tmp_path) is None
    token = page_token("0.0.0.0", tmp_path)
    assert token and (tmp_path / "page.token").read_text().strip() == token
    assert (tmp_path / "page.token").stat().st_mode & 0o077 == 0
    pages = JobPages(lambda: None, token)
    assert pages("/metrics", {}) is None
    assert pages("/", {})[0] == 401 and pages("/jobs/x?token=wrong", {})[0] == 401
    code, _, _, headers = pages(f"/?token={token}", {})
    assert code == 503 and "marind_token=" in headers["Set-Cookie"]         # let in; etcd not there yet
    assert pages("/", {"Authorization": f"Bearer {token}"})[0] == 503
    assert pages("/", {"Cookie": f"marind_token={token}"})[0] == 503
    monkeypatch.setenv("MARIND_PAGE_TOKEN", "chosen")
    assert page_token("10.0.0.1", tmp_path / "other") == "chosen"


def test_a_cluster_row_from_its_keys():
    from marind.agent.page.cluster_read import row

    r = row("j1", {"spec": {"job": {"name": "tiny"}, "train": {"steps": 40}},
                   "state": {"state": "FAILED", "reason": "torchrun gave up", "restarts": 3, "updated_at": 5.0, "step": 12},
                   "progress": {"step": 10, "world_size": 4, "updated_at": 9.0},
                   "last_error": {"line": "ValueError: bad"}, "ledger": {"ledger": {"goodput": 0.75}}},
            ["b", "a"], submitted_rev=7)
    assert (r["name"], r["state"], r["reason"], r["step"], r["target_steps"]) == ("tiny", "FAILED", "ValueError: bad", 12, 40)
    assert (r["restarts"], r["goodput"], r["updated_at"], r["world_size"]) == (3, 0.75, 9.0, 4)
    empty = row("j2", {"spec": "not json", "state": None, "ledger": {"ledger": None}}, [])
    assert (empty["state"], empty["goodput"], empty["step"], empty["target_steps"]) == ("PENDING", None, None, None)

"""The job page's routes on the agent's metrics port (docs/design.md §11, *the job page*).

``/`` (the cluster), ``/jobs/JOB`` (one job), and their JSON twins ``/api/cluster`` and
``/api/jobs/JOB`` (``{at, html, data}``: what the page's script swaps in). Read-only: GET only.

On a loopback address (the default ``[metrics] host = "127.0.0.1"``) anyone on the host may
look. On any other address the page asks for a token: ``MARIND_PAGE_TOKEN`` when set, else
one made at start and written to ``{state_dir}/page.token`` (mode 0600); a request gives it as
``?token=...`` (then kept in a cookie for the links) or ``Authorization: Bearer ...``.
``/metrics`` and ``/healthz`` stay open as before.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from collections.abc import Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from marind.agent.page import data, html
from marind.core.errors import ControlPlaneUnavailable
from marind.core.etcd_client import EtcdClient
from marind.core.log import get_logger

#: (status, body, content type, extra headers) or None: not a page route.
Response = tuple[int, str, str, dict[str, str]]
_HTML, _JSON, _TEXT = "text/html; charset=utf-8", "application/json", "text/plain; charset=utf-8"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def page_token(host: str, state_dir: str | Path) -> str | None:
    """The token the page asks for on ``host`` (None on loopback); made and written once when not set."""
    if is_loopback(host):
        return None
    token = os.environ.get("MARIND_PAGE_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        path = Path(state_dir) / "page.token"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
        except OSError as exc:     # a full state dir: the page asks for a token nobody can read; set MARIND_PAGE_TOKEN
            get_logger(__name__).warning("page_token_unwritten", path=str(path), error=str(exc),
                                         fix="set MARIND_PAGE_TOKEN, or free space and restart the agent")
    return token


class JobPages:
    """The page routes, over the agent's etcd client.

    Args:
        client: the agent's etcd client (None until it connected).
        token: what a request must present (None: no token asked).
    """

    def __init__(self, client: Callable[[], EtcdClient | None], token: str | None = None):
        self._client, self.token = client, token
        self.log = get_logger(__name__)

    def __call__(self, path: str, headers: dict[str, str]) -> Response | None:
        url = urlsplit(path)
        route = unquote(url.path)
        if not (route == "/" or route.startswith("/jobs/") or route.startswith("/api/")):
            return None
        query = parse_qs(url.query)
        extra: dict[str, str] = {}
        if self.token is not None:
            given = (query.get("token") or [""])[0] or _bearer(headers) or _cookie(headers)
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return 401, "the job page asks for its token here: ?token=... (see {state_dir}/page.token)\n", _TEXT, {}
            if query.get("token"):
                extra["Set-Cookie"] = f"marind_token={self.token}; HttpOnly; SameSite=Strict; Path=/"
        client = self._client()
        try:
            out = self._route(client, route) if client is not None else (503, "not connected to etcd yet\n", _TEXT, {})
        except ControlPlaneUnavailable as exc:
            out = 503, f"etcd unavailable: {exc}\n", _TEXT, {}
        return out[0], out[1], out[2], {**out[3], **extra}

    def _route(self, client: EtcdClient, route: str) -> Response:
        if route in ("/", "/api/cluster"):
            cluster = data.cluster(client)
            part = html.cluster_part(cluster)
            if route == "/":
                return 200, html.shell("marind: the cluster", "/api/cluster", part), _HTML, {}
            return 200, json.dumps({"at": cluster["at"], "html": part, "data": cluster}), _JSON, {}
        api = route.startswith("/api/jobs/")
        job = route[len("/api/jobs/"):] if api else route[len("/jobs/"):]
        doc: dict[str, Any] | None = data.job_or_none(client, job) if job and "/" not in job else None
        if doc is None:
            return 404, f"no job {job!r}: see / for the jobs\n", _TEXT, {}
        part = html.job_part(doc)
        if not api:
            return 200, html.shell(f"marind: job {job}", f"/api/jobs/{job}", part), _HTML, {}
        return 200, json.dumps({"at": doc["at"], "html": part, "data": _jsonable(doc)}), _JSON, {}


def _jsonable(doc: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(doc, default=str))


def _bearer(headers: dict[str, str]) -> str:
    auth = headers.get("Authorization") or headers.get("authorization") or ""
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _cookie(headers: dict[str, str]) -> str:
    raw = headers.get("Cookie") or headers.get("cookie") or ""
    morsel = SimpleCookie(raw).get("marind_token")
    return morsel.value if morsel else ""

"""An S3 that pushes back: a fault-injecting HTTP proxy in front of a real S3 endpoint.

``S3FaultProxy(upstream)`` listens on 127.0.0.1 and forwards every request to ``upstream``
(the test SeaweedFS: ``marind.testing.s3_server``) unchanged, the ``Host`` header included, so
SigV4 signatures made for the proxy's address still verify. Faults are rules, set and cleared
from the test at any time (``inject``, ``storm``, ``clear``), each for a share of the requests
(``rate``, drawn from a seeded ``random.Random``: a run is repeatable) and for a time window:

* ``status``: answer with that HTTP status and S3's XML error body (503 ``SlowDown``, 500
  ``InternalError``), without forwarding;
* ``reset``: drop the connection without an answer (a connection reset);
* ``delay_s``: hold the request that long, then forward it.

Every request and every fault is counted (``counts``): a test shows that its faults happened.
The proxy runs on an event loop of its own, in a daemon thread; ``stop()`` ends it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

from aiohttp import ClientSession, ClientTimeout, web

from marind.core.log import get_logger
from marind.core.netutil import free_port

log = get_logger(__name__)

#: S3's error code and message per status the proxy answers with
_S3_ERRORS = {503: ("SlowDown", "Please reduce your request rate."),
              500: ("InternalError", "We encountered an internal error. Please try again."),
              502: ("BadGateway", "Bad gateway."),
              504: ("GatewayTimeout", "Gateway timeout.")}
#: hop-by-hop headers the proxy never copies
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
        "content-length", "content-encoding"}


@dataclass
class FaultRule:
    """One kind of fault for a share of the requests during a window.

    Attributes:
        status: answer with this HTTP status (an S3 XML error body) instead of forwarding; 0: none.
        reset: drop the connection instead of answering.
        delay_s: hold each hit request this long before forwarding (or failing) it.
        rate: the share of requests hit, 0..1.
        start: ``time.monotonic()`` from when it applies; ``until``: to when (None: until cleared).
        methods: only requests with these HTTP methods (empty: all).
    """

    status: int = 0
    reset: bool = False
    delay_s: float = 0.0
    rate: float = 1.0
    start: float = 0.0
    until: float | None = None
    methods: tuple[str, ...] = ()
    hits: int = field(default=0)

    def active(self, now: float, method: str) -> bool:
        """Does this rule apply to a ``method`` request at ``now``?"""
        if now < self.start or (self.until is not None and now >= self.until):
            return False
        return not self.methods or method in self.methods


def error_body(status: int, resource: str) -> bytes:
    """S3's XML error document for ``status`` (SlowDown for 503, InternalError for 500)."""
    code, message = _S3_ERRORS.get(status, ("ServiceUnavailable", "Service unavailable."))
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{resource}</Resource><RequestId>marind-fault</RequestId></Error>").encode()


class S3FaultProxy:
    """A fault-injecting proxy in front of the S3 endpoint ``upstream`` (see the module docstring).

    Args:
        upstream: the real endpoint, ``http://HOST:PORT``.
        seed: seeds the draw of which requests a rule hits.
        host: the address to listen on.
    """

    def __init__(self, upstream: str, seed: int = 0, host: str = "127.0.0.1"):
        self.upstream = upstream.rstrip("/")
        self.host, self.port = host, free_port()
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "forwarded": 0, "status": 0, "reset": 0, "delayed": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._session: ClientSession | None = None

    @property
    def endpoint(self) -> str:
        """The proxy's endpoint, ``http://HOST:PORT``: give it to the clients instead of ``upstream``."""
        return f"http://{self.host}:{self.port}"

    def storage_options(self, base: dict) -> dict:
        """``base`` (``SeaweedS3.storage_options``) with its endpoint pointed at the proxy."""
        client = dict(base.get("client_kwargs") or {})
        client["endpoint_url"] = self.endpoint
        return {**base, "client_kwargs": client}

    # -- control ---------------------------------------------------------------------------
    def inject(self, *, status: int = 0, reset: bool = False, delay_s: float = 0.0, rate: float = 1.0,
               after_s: float = 0.0, duration_s: float | None = None, methods: tuple[str, ...] = ()) -> FaultRule:
        """Add a rule from ``after_s`` seconds from now, for ``duration_s`` seconds (None: until cleared).

        Raises:
            ValueError: a rate outside 0..1, a negative delay or duration, or a rule that does nothing.
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate!r}: use a share of the requests from 0 to 1")
        if delay_s < 0 or (duration_s is not None and duration_s < 0) or after_s < 0:
            raise ValueError("delay_s, after_s and duration_s must be >= 0")
        if not (status or reset or delay_s):
            raise ValueError("a fault rule needs status=, reset=True or delay_s=")
        now = time.monotonic()
        rule = FaultRule(status=status, reset=reset, delay_s=delay_s, rate=rate, start=now + after_s,
                         until=None if duration_s is None else now + after_s + duration_s,
                         methods=tuple(m.upper() for m in methods))
        with self._lock:
            self._rules.append(rule)
        log.info("s3_fault_injected", status=status, reset=reset, delay_s=delay_s, rate=rate,
                 after_s=after_s, duration_s=duration_s)
        return rule

    def storm(self, duration_s: float, status: int = 503, rate: float = 1.0, after_s: float = 0.0) -> FaultRule:
        """A storm of ``status`` answers (503 SlowDown by default) for ``duration_s`` seconds."""
        return self.inject(status=status, rate=rate, after_s=after_s, duration_s=duration_s)

    def clear(self) -> None:
        """Remove every rule: requests are forwarded untouched again."""
        with self._lock:
            self._rules.clear()

    def _draw(self, method: str) -> FaultRule | None:
        now = time.monotonic()
        with self._lock:
            self.counts["requests"] += 1
            for rule in self._rules:
                if rule.active(now, method) and self._rng.random() < rule.rate:
                    rule.hits += 1
                    return rule
        return None

    # -- serving ---------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rule = self._draw(request.method)
        body = await request.read()
        if rule is not None and rule.delay_s:
            self._count("delayed")
            await asyncio.sleep(rule.delay_s)
        if rule is not None and rule.reset:
            self._count("reset")
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("marind fault proxy: connection reset")
        if rule is not None and rule.status:
            self._count("status")
            return web.Response(status=rule.status, body=error_body(rule.status, request.path),
                                headers={"Content-Type": "application/xml", "x-amz-request-id": "marind-fault"})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.rel_url.raw_path_qs,
                                         headers=headers, data=body if body else None,
                                         allow_redirects=False, auto_decompress=False) as up:
            payload = await up.read()
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            self._count("forwarded")
            resp = web.StreamResponse(status=up.status, headers=out)
            head = request.method == "HEAD"    # its Content-Length is the object's, with no body
            resp.content_length = int(up.headers.get("Content-Length", 0)) if head else len(payload)
            await resp.prepare(request)
            if payload and not head:
                await resp.write(payload)
            await resp.write_eof()
            return resp

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    async def _serve(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        self._session = ClientSession(timeout=ClientTimeout(total=300), skip_auto_headers=("User-Agent",))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        ready.set()
        await self._stopped.wait()
        await runner.cleanup()
        await self._session.close()

    def start(self) -> S3FaultProxy:
        """Serve in a daemon thread; returns once it listens."""
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._serve(ready))
            self._loop.close()
        self._thread = threading.Thread(target=run, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError(f"the S3 fault proxy did not start listening on {self.endpoint} within 30s")
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(30)
        self._thread = None

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["FaultRule", "S3FaultProxy", "error_body"]

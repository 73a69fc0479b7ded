"""Prometheus metrics of the agent, served on a localhost port.

Stdlib only: counters, gauges and a histogram rendered in the text
exposition format, and a threaded ``http.server`` answering ``/metrics``
and ``/healthz`` (200 when the agent reaches etcd, 503 otherwise).
Names follow Prometheus conventions: the ``marind_`` prefix, base units,
``_total`` on counters, bounded labels (never a step).

Per-job series (``JOB_SERIES``) carry one label, ``job`` (the job's id), and
are removed when the job is gone from this agent (``remove_job``), so
their number is bounded by the jobs the agent runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from marind import __version__

#: The per-job series, labelled ``job`` only; ``remove_job`` drops them.
JOB_SERIES = ("marind_job_step", "marind_job_loss", "marind_job_tokens_per_second", "marind_job_restarts_total",
              "marind_job_last_checkpoint_step", "marind_checkpoint_duration_seconds", "marind_job_seconds_total")

_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, float("inf"))


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v)}"'.replace("\n", " ") for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metrics:
    """The agent's metrics; thread-safe; ``render()`` gives the exposition text."""

    def __init__(self):
        self._lock = threading.Lock()
        self.help = {
            "marind_build_info": ("gauge", "marind version running this agent"),
            "marind_restarts_total": ("counter", "worker restarts seen by this agent"),
            "marind_rendezvous_rounds_total": ("counter", "rendezvous rounds (worker generations) on this node"),
            "marind_hangs_total": ("counter", "hung worker generations killed by this agent"),
            "marind_nodes": ("gauge", "nodes registered in etcd"),
            "marind_jobs": ("gauge", "jobs this agent runs"),
            "marind_etcd_keepalive_failures_total": ("counter", "failed lease keep-alives"),
            "marind_etcd_up": ("gauge", "1 when etcd answered the last request"),
            "marind_state_dir_full": ("gauge", "1 while the agent's state dir counts as full (ENOSPC/EDQUOT)"),
            "marind_state_dir_free_bytes": ("gauge", "free bytes on the state dir's filesystem at the last look"),
            "marind_checkpoint_duration_seconds": (
                "histogram", "seconds from the end of a step to its checkpoint's commit, as rank 0 reports it"),
            "marind_job_step": ("gauge", "the job's step (rank 0's where it runs here, else this node's)"),
            "marind_job_loss": ("gauge", "the job's loss at its last step (rank 0)"),
            "marind_job_tokens_per_second": ("gauge", "the job's tokens per second (rank 0)"),
            "marind_job_restarts_total": ("counter", "the job's worker restarts on this node"),
            "marind_job_last_checkpoint_step": ("gauge", "the job's last committed checkpoint step"),
            "marind_job_compute_seconds": ("gauge", "median compute seconds per step of this node's ranks"),
            "marind_job_stragglers": ("gauge", "the job's ranks named stragglers now (on the agent that runs rank 0)"),
            "marind_job_seconds_total": (
                "counter", "the job's wall time by cause (goodput ledger, settled time; where global rank 0 runs)"),
        }
        self._values: dict[tuple[str, tuple], float] = {}
        self._hist: dict[tuple[str, tuple], list] = {}
        self.set("marind_build_info", 1, version=__version__)

    def inc(self, name: str, by: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + by

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = float(value)

    def observe(self, name: str, value: float, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            counts = self._hist.setdefault(key, [[0] * len(_BUCKETS), 0.0, 0])
            for i, bound in enumerate(_BUCKETS):
                if value <= bound:
                    counts[0][i] += 1
            counts[1] += value
            counts[2] += 1

    def remove_job(self, job: str) -> None:
        """Drop every per-job series of ``job`` (the job is gone from this agent)."""
        label = ("job", job)
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if label not in k[1]}
            self._hist = {k: v for k, v in self._hist.items() if label not in k[1]}

    def value(self, name: str, **labels) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self) -> str:
        out = []
        with self._lock:
            for name, (kind, text) in self.help.items():
                out.append(f"# HELP {name} {text}")
                out.append(f"# TYPE {name} {kind}")
                if kind == "histogram":
                    for (n, labels), (buckets, total, count) in sorted(self._hist.items()):
                        if n != name:
                            continue
                        for bound, c in zip(_BUCKETS, buckets):
                            out.append(f"{name}_bucket{_labels({**dict(labels), 'le': _fmt(bound)})} {c}")
                        out.append(f"{name}_sum{_labels(dict(labels))} {_fmt(total)}")
                        out.append(f"{name}_count{_labels(dict(labels))} {count}")
                    continue
                rows = [(labels, v) for (n, labels), v in sorted(self._values.items()) if n == name]
                if not rows and kind == "counter" and name not in JOB_SERIES:
                    rows = [((), 0.0)]
                for labels, v in rows:
                    out.append(f"{name}{_labels(dict(labels))} {_fmt(v)}")
        return "\n".join(out) + "\n"


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``host:port`` (port 0: any free port) in a thread; the job
    page's routes too when ``pages`` is given."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 9465,
                 healthy: Callable[[], tuple[bool, str]] = lambda: (True, "ok"),
                 pages: Callable[[str, dict[str, str]], tuple[int, str, str, dict[str, str]] | None] | None = None):
        self.metrics = metrics
        self.healthy = healthy
        self.pages = pages        # the job page's routes (``marind.agent.page.server.JobPages``)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] == "/metrics":
                    self._send(200, server.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
                elif self.path.split("?")[0] == "/healthz":
                    ok, text = server.healthy()
                    self._send(200 if ok else 503, text + "\n", "text/plain; charset=utf-8")
                elif server.pages is not None and (page := server.pages(self.path, dict(self.headers))):
                    self._send(*page)
                else:
                    self._send(404, "not found: try /metrics, /healthz or / (the job page)\n", "text/plain")

            def _send(self, code, body, ctype, headers=None):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: the agent logs through structlog
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="marind-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

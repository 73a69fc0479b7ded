"""Where etcd is and how to speak to it: endpoint lists, TLS files, gRPC's channel options
(``marind.core.etcd_client`` builds its channels from them)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

# gRPC's defaults suit a server that is gone for good, not an etcd that restarts. After a
# failed connect it waits 1 s, then 1.6x longer each time up to 120 s, and every call in
# between fails at once, so a client whose etcd came back after an outage stayed
# "unreachable" for seconds more (docs/perf.md, "Control plane"), and after a few minutes
# it would stay so for up to 2 minutes, outliving a node lease. Its subchannels are also
# shared per process, so a client made after the restart inherited the old one's backoff
# and failed its first call. Retry about once a second (gRPC adds 20% jitter), with a
# subchannel of our own.
GRPC_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True)
class EtcdTLS:
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None


def parse_endpoints(spec: str | list[str]) -> list[tuple[str, int, bool]]:
    """``"http://a:2379,https://b:2379"`` or ``"a:2379"`` -> [(host, port, secure)]."""
    items = spec if isinstance(spec, list) else [s for s in spec.split(",") if s.strip()]
    out = []
    for item in items:
        item = item.strip()
        if "://" not in item:
            item = "http://" + item
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad etcd endpoint {item!r}: expected http://HOST:PORT or HOST:PORT")
        out.append((parts.hostname, parts.port or 2379, parts.scheme == "https"))
    if not out:
        raise ValueError("no etcd endpoints given: pass --etcd http://HOST:PORT or set MARIND_ETCD")
    return out


def read_file(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()



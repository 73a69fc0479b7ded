"""Agent settings and the one etcd endpoint lookup.

Precedence (lowest first): built-in defaults < the config file
(``--config``, else ``$MARIND_CONFIG``, else ``/etc/marind/marind.toml``
when present) < ``MARIND_*`` environment variables < command-line flags.

The control plane address (docs/design.md §5): ``--etcd``, then ``MARIND_ETCD``,
then ``etcd.endpoints`` in the config file, then the embedded default:
the agent starts a local etcd under its state dir and writes its endpoint
to ``{state_dir}/etcd.endpoint``; the CLI reads that file from
``$MARIND_STATE_DIR``, ``$STATE_DIRECTORY`` (systemd), the per-user
``~/.local/state/marind`` and ``/var/lib/marind``, in that order.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marind.core.errors import ControlPlaneUnavailable, SpecError
from marind.core.etcd_client import DEFAULT_PREFIX
from marind.core.etcd_endpoints import EtcdTLS
from marind.core.schema import closest, load_toml, string_pairs

SYSTEM_CONFIG = "/etc/marind/marind.toml"
SYSTEM_STATE_DIR = "/var/lib/marind"
ENDPOINT_FILE = "etcd.endpoint"


def user_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "marind"


def default_state_dir() -> Path:
    """systemd's ``$STATE_DIRECTORY``, else /var/lib/marind for root, else the per-user dir."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path(SYSTEM_STATE_DIR)
    return user_state_dir()


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    node: str = field(default_factory=socket.gethostname)
    etcd: str = ""                      # "" = embedded local etcd
    prefix: str = DEFAULT_PREFIX
    etcd_user: str | None = None
    etcd_password: str | None = None
    etcd_ca_cert: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    slots: int = 0                      # 0 = CPU count (or GPU count when there are GPUs)
    labels: tuple[tuple[str, str], ...] = ()
    lease_ttl: int = 10
    report_interval: float = 2.0        # seconds between etcd writes of progress/records
    etcd_compact_interval: float = 300.0   # seconds between the agent's compactions of etcd's history; 0 = off
    stop_timeout: float = 60.0          # SIGTERM -> SIGKILL grace for a job's workers
    metrics_port: int = 9465            # 0 = off; -1 = any free port
    metrics_host: str = "127.0.0.1"
    rdzv_conf: str = ""                 # extra --rdzv-conf items, e.g. "keep_alive_interval=2"
    python: str = ""                    # interpreter for torchrun ("" = this one)
    trusted_keys: tuple[str, ...] = ()  # Ed25519 public key files whose signed jobs this agent runs
    require_signed_jobs: bool = False   # refuse every job not signed by one of trusted_keys
    sign_key: str | None = None         # the CLI's: sign every `marind submit` with this private key

    @property
    def tls(self) -> EtcdTLS:
        return EtcdTLS(ca_cert=self.etcd_ca_cert, cert=self.etcd_cert, key=self.etcd_key)

    @property
    def embedded(self) -> bool:
        return not self.etcd

    def effective_slots(self) -> int:
        if self.slots > 0:
            return self.slots
        try:
            import torch
            if torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:
            pass
        return os.cpu_count() or 1


# TOML layout: [agent] node, state_dir, slots, labels, lease_ttl, ...;  [etcd] endpoints, prefix,
# user, password, ca_cert, cert, key;  [metrics] port, host;  [client] sign_key
_TOML_KEYS = {
    ("agent", "node"): "node", ("agent", "state_dir"): "state_dir", ("agent", "slots"): "slots",
    ("agent", "labels"): "labels", ("agent", "lease_ttl"): "lease_ttl",
    ("agent", "report_interval"): "report_interval", ("agent", "stop_timeout"): "stop_timeout",
    ("agent", "rdzv_conf"): "rdzv_conf", ("agent", "python"): "python",
    ("agent", "trusted_keys"): "trusted_keys", ("agent", "require_signed_jobs"): "require_signed_jobs",
    ("client", "sign_key"): "sign_key",
    ("etcd", "endpoints"): "etcd", ("etcd", "prefix"): "prefix", ("etcd", "user"): "etcd_user",
    ("etcd", "password"): "etcd_password", ("etcd", "ca_cert"): "etcd_ca_cert",
    ("etcd", "cert"): "etcd_cert", ("etcd", "key"): "etcd_key", ("etcd", "compact_interval"): "etcd_compact_interval",
    ("metrics", "port"): "metrics_port", ("metrics", "host"): "metrics_host",
}
_ENV_KEYS = {
    "MARIND_NODE": "node", "MARIND_ETCD": "etcd", "MARIND_PREFIX": "prefix",
    "MARIND_ETCD_USER": "etcd_user", "MARIND_ETCD_PASSWORD": "etcd_password",
    "MARIND_STATE_DIR": "state_dir", "MARIND_SLOTS": "slots", "MARIND_METRICS_PORT": "metrics_port",
    "MARIND_RDZV_CONF": "rdzv_conf", "MARIND_LEASE_TTL": "lease_ttl",
    "MARIND_REPORT_INTERVAL": "report_interval", "MARIND_STOP_TIMEOUT": "stop_timeout",
    "MARIND_SIGN_KEY": "sign_key", "MARIND_ETCD_COMPACT_INTERVAL": "etcd_compact_interval",
}


def config_path(explicit: str | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    if os.environ.get("MARIND_CONFIG"):
        return Path(os.environ["MARIND_CONFIG"])
    return Path(SYSTEM_CONFIG) if Path(SYSTEM_CONFIG).is_file() else None


def parse_config_text(text: str, source: str = "marind.toml") -> dict[str, Any]:
    """TOML -> {AgentConfig field: value}; unknown keys are rejected with a did-you-mean."""
    data = load_toml(text, source)
    out: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise SpecError(f"{source}: {section} must be a table like [agent] or [etcd]")
        for key, value in table.items():
            target = _TOML_KEYS.get((section, key))
            if target is None:
                known = [f"{s}.{k}" for s, k in _TOML_KEYS]
                hint = closest(f"{section}.{key}", known)
                raise SpecError(f"{source}: unknown key {section}.{key}"
                                + (f"; did you mean {hint}?" if hint else ""))
            if target == "etcd" and isinstance(value, list):
                value = ",".join(value)
            if target == "trusted_keys":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise SpecError(f"{source}: agent.trusted_keys must be a list of public key files")
                value = tuple(value)
            if target == "require_signed_jobs" and not isinstance(value, bool):
                raise SpecError(f"{source}: agent.require_signed_jobs must be true or false")
            if target == "labels":
                if not isinstance(value, dict):
                    raise SpecError(f"{source}: agent.labels must be a table of strings")
                value = string_pairs(value)
            out[target] = value
    return out


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(AgentConfig)}[name]
    try:
        if name == "state_dir":
            return Path(value).expanduser()
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{source}: {name} must be a number, got {value!r}") from None
    return value


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    cfg = config_path(path)
    if cfg is not None:
        try:
            text = cfg.read_text()
        except OSError as exc:
            raise SpecError(f"cannot read config {cfg}: {exc.strerror or exc}") from exc
        for k, v in parse_config_text(text, str(cfg)).items():
            values[k] = _coerce(k, v, str(cfg))
    for var, name in _ENV_KEYS.items():
        if env.get(var):
            values[name] = _coerce(name, env[var], var)
    for name, value in (flags or {}).items():
        if value is not None:
            values[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    config = AgentConfig(**values)
    if config.slots < 0 or config.lease_ttl < 2:
        raise SpecError("agent.slots must be >= 0 and agent.lease_ttl >= 2")
    if config.etcd_compact_interval != 0 and config.etcd_compact_interval < 60:
        raise SpecError(f"etcd.compact_interval = {config.etcd_compact_interval:g}: give 0 (off) or at least 60 "
                        "seconds (history younger than one interval is kept for watches)")
    if config.require_signed_jobs and not config.trusted_keys:
        raise SpecError("agent.require_signed_jobs is set but agent.trusted_keys lists no key: "
                        "list the public key files of who may submit (marind keygen)")
    return config


# -- where the CLI finds etcd ------------------------------------------------------------------

def endpoint_file(state_dir: str | Path) -> Path:
    return Path(state_dir) / ENDPOINT_FILE


def endpoint_file_candidates(env: Mapping[str, str] | None = None) -> list[Path]:
    env = os.environ if env is None else env
    dirs = []
    if env.get("MARIND_STATE_DIR"):
        dirs.append(Path(env["MARIND_STATE_DIR"]).expanduser())
    if env.get("STATE_DIRECTORY"):
        dirs.append(Path(env["STATE_DIRECTORY"].split(":")[0]))
    dirs += [user_state_dir(), Path(SYSTEM_STATE_DIR)]
    return [endpoint_file(d) for d in dirs]


def resolve_endpoint(flag: str | None = None, config_file: str | None = None,
                     env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(endpoints, where they came from), in the documented order; raises when none is found."""
    env = os.environ if env is None else env
    if flag:
        return flag, "--etcd"
    if env.get("MARIND_ETCD"):
        return env["MARIND_ETCD"], "MARIND_ETCD"
    cfg = config_path(config_file)
    if cfg is not None and cfg.is_file():
        values = parse_config_text(cfg.read_text(), str(cfg))
        if values.get("etcd"):
            return values["etcd"], str(cfg)
    for candidate in endpoint_file_candidates(env):
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text:
            return text, str(candidate)
    raise ControlPlaneUnavailable(
        "no etcd configured: pass --etcd http://HOST:PORT, set MARIND_ETCD, set etcd.endpoints in "
        f"{SYSTEM_CONFIG}, or start `marind agent` (it runs an embedded etcd)")


def client_settings(config_file: str | None = None, env: Mapping[str, str] | None = None) -> dict:
    """prefix/user/password/TLS for CLI clients: config file < env."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    cfg = config_path(config_file)
    if cfg is not None and cfg.is_file():
        values.update(parse_config_text(cfg.read_text(), str(cfg)))
    prefix = env.get("MARIND_PREFIX") or values.get("prefix") or DEFAULT_PREFIX
    return {"prefix": prefix,
            "user": env.get("MARIND_ETCD_USER") or values.get("etcd_user"),
            "password": env.get("MARIND_ETCD_PASSWORD") or values.get("etcd_password"),
            "tls": EtcdTLS(ca_cert=values.get("etcd_ca_cert"), cert=values.get("etcd_cert"),
                           key=values.get("etcd_key"))}


def sign_key_setting(flag: str | None = None, config_file: str | None = None,
                     env: Mapping[str, str] | None = None) -> str | None:
    """The private key `marind submit` signs with: ``--sign-key``, else ``MARIND_SIGN_KEY``, else
    ``[client] sign_key`` in the config file, else None (unsigned)."""
    env = os.environ if env is None else env
    if flag or env.get("MARIND_SIGN_KEY"):
        return flag or env["MARIND_SIGN_KEY"]
    cfg = config_path(config_file)
    if cfg is not None and cfg.is_file():
        return parse_config_text(cfg.read_text(), str(cfg)).get("sign_key")
    return None

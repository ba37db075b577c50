"""``AgentConfig``: settings of the replica sidecar (``kvroute sidecar``).

Rules:
  1. Frozen; built once by :func:`load_config` from an injected ``environ`` mapping and ``argv``
     (flags win over ``KVROUTE_SIDECAR_*`` variables, which win over defaults).
  2. Everything is validated at start-up; a :class:`router.errors.ConfigError` names the flag.
  3. A URL in an error message is shown through :func:`redact_url`: never its password.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from router.errors import ConfigError
from router.model import rank_replica_id
from router.observability.logging import redact_url
from router.store.url import check_redis_url

__all__ = ["ENV_PREFIX", "AgentConfig", "build_arg_parser", "load_config", "replica_id_for"]

ENV_PREFIX = "KVROUTE_SIDECAR_"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    engine_url: str = "http://127.0.0.1:30000"  # the engine in this pod, as the sidecar reaches it
    advertise_url: str = ""  # how gateways reach the engine ("" = engine_url)
    replica_id: str = ""  # "" = host:port of advertise_url
    model: str = ""  # "" = served_model_name from the engine
    listen_host: str = "0.0.0.0"  # /healthz, /readyz, /drain, /status
    listen_port: int = 8081  # 0 = any free port (printed on start)
    redis_url: str | None = None  # shared registry (RedisStore); else the gateways' admin API
    gateways: tuple[str, ...] = ()  # gateway base URLs for the admin API path
    admin_token: str | None = None
    key_prefix: str = "kvroute"
    heartbeat_interval_s: float = 1.0
    replica_ttl_s: float = 5.0  # registry entry TTL (Redis); must exceed the heartbeat interval
    health_interval_s: float = 5.0  # engine /health is a 1-token generate on SGLang: not every beat
    health_path: str = "/health"
    probe_timeout_s: float = 5.0
    unhealthy_after: int = 3  # consecutive failed health checks -> the replica leaves the registry
    engine_wait_timeout_s: float = 0.0  # give up waiting for the engine's first /health (0 = never)
    drain_timeout_s: float = 600.0  # SIGTERM: wait at most this long for in-flight to reach 0
    drain_grace_s: float = 1.0  # in-flight must stay 0 this long (gateways' snapshots catch up)
    capacity_tokens: int = 0  # override /server_info max_total_num_tokens (0 = from the engine)
    host_capacity_tokens: int = 0  # override the HiCache host tier size (0 = from the engine)
    kv_events: bool = False  # follow the engine's KV events, share its residency through Redis
    # register one data-parallel rank of the engine (--dp-size) as a replica of its own: one sidecar
    # per rank, each reading its rank's load and KV events (the gateway's --replica-dp-ranks)
    dp_rank: int | None = None

    @property
    def advertised(self) -> str:
        return self.advertise_url or self.engine_url

    @property
    def id(self) -> str:
        if self.replica_id:
            return self.replica_id
        rid = replica_id_for(self.advertised)
        return rid if self.dp_rank is None else rank_replica_id(rid, self.dp_rank)


def replica_id_for(url: str) -> str:
    """``host:port`` of a URL (same rule as the gateway's static replicas)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


def _check_url(key: str, url: str) -> str:
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ConfigError(f"{key}: expected an http(s) URL with a host, got {shown!r}")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"{key}: bad port in {shown!r}") from exc
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: no query or fragment allowed in {shown!r}")
    return url.rstrip("/")


def _check_redis_url(url: str) -> str:
    """The gateway's check (:func:`router.store.url.check_redis_url`), naming the flag."""
    try:
        return check_redis_url(url)
    except ValueError as exc:
        raise ConfigError(f"--redis: {exc}") from None


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute sidecar",
        description="Replica sidecar: wait for the engine, register it (Redis registry or the gateways' "
        "admin API), heartbeat its load, serve /healthz and /readyz, drain on SIGTERM. Every flag "
        f"also reads {ENV_PREFIX}<FLAG_NAME> (e.g. {ENV_PREFIX}REDIS_URL).",
    )
    a = p.add_argument
    a("--engine-url", help="engine base URL as seen from the sidecar (default http://127.0.0.1:30000)")
    a("--advertise-url", help="engine URL gateways use (default: --engine-url)")
    a("--replica-id", help="replica id (default host:port of the advertised URL)")
    a("--model", help="model name to register (default: the engine's served_model_name)")
    a("--listen-host", help="probe server host (default 0.0.0.0)")
    a("--listen-port", type=int, help="probe server port (default 8081; 0 = free port)")
    a("--redis", dest="redis_url", help="Redis URL of the shared registry")
    a("--gateway", dest="gateways", action="append", help="gateway base URL for the admin API (repeatable)")
    a("--admin-token", help="bearer token of the gateways' admin API")
    a("--key-prefix", help="Redis key prefix (default kvroute)")
    a("--heartbeat-interval", dest="heartbeat_interval_s", type=float, help="seconds (default 1)")
    a("--replica-ttl", dest="replica_ttl_s", type=float, help="registry TTL seconds (default 5)")
    a("--health-interval", dest="health_interval_s", type=float, help="seconds between engine /health")
    a("--health-path", help="engine health path (default /health)")
    a("--probe-timeout", dest="probe_timeout_s", type=float, help="seconds per engine request")
    a("--unhealthy-after", type=int, help="failed health checks before the replica is marked down")
    a("--engine-wait-timeout", dest="engine_wait_timeout_s", type=float, help="0 = wait forever")
    a("--drain-timeout", dest="drain_timeout_s", type=float, help="max seconds to drain on SIGTERM")
    a("--drain-grace", dest="drain_grace_s", type=float, help="seconds in-flight must stay 0")
    a("--capacity-tokens", type=int, help="override the engine's KV capacity")
    a("--host-capacity-tokens", type=int, help="override the host-tier KV capacity")
    a("--kv-events", action="store_true", default=None,
      help="subscribe to the engine's KV events (its /server_info kv_events) and share its exact residency "
      "through Redis (needs --redis and the kvevents extra; docs/KV_EVENTS.md)")
    a("--dp-rank", type=int,
      help="register this data-parallel rank of the engine (SGLang --dp-size) as a replica of its own, "
      "id host:port-dpN: run one sidecar per rank (docs/DEPLOY.md)")
    return p


_CASTS: dict[str, str] = {f.name: str(f.type) for f in fields(AgentConfig)}  # annotations are strings


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    aliases = {"REDIS": "redis_url", "GATEWAY": "gateways"}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :]
        field_name = aliases.get(name, name.lower())
        if field_name not in _CASTS:
            # flags with a unit suffix read naturally without it too (HEARTBEAT_INTERVAL)
            if f"{field_name}_s" in _CASTS:
                field_name = f"{field_name}_s"
            else:
                raise ConfigError(f"{key}: unknown sidecar setting")
        out[field_name] = _cast(field_name, raw, key)
    return out


def _cast(name: str, raw: str, origin: str) -> Any:
    kind = _CASTS[name]
    try:
        if name == "gateways":
            return tuple(u.strip() for u in raw.split(",") if u.strip())
        if kind in ("int", "int | None"):
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw.strip().lower() in {"1", "true", "yes", "on"}
    except ValueError as exc:
        raise ConfigError(f"{origin}: expected a number, got {raw!r}") from exc
    return raw or None if "None" in kind else raw


def load_config(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> AgentConfig:
    values = _from_env(environ or {})
    ns = build_arg_parser().parse_args(list(argv))
    for k, v in vars(ns).items():
        if v is not None:
            values[k] = tuple(v) if k == "gateways" else v
    return validate(AgentConfig(**values))


def validate(cfg: AgentConfig) -> AgentConfig:
    """Cross-field checks; returns ``cfg`` with normalised URLs."""
    engine = _check_url("--engine-url", cfg.engine_url)
    advertise = _check_url("--advertise-url", cfg.advertise_url) if cfg.advertise_url else ""
    gateways = tuple(_check_url("--gateway", g) for g in cfg.gateways)
    if cfg.redis_url is not None:
        _check_redis_url(cfg.redis_url)
    if cfg.redis_url is None and not gateways:
        raise ConfigError("need a registry: --redis URL or at least one --gateway URL (admin API)")
    if not 0 <= cfg.listen_port < 65536:
        raise ConfigError(f"--listen-port must be 0..65535, got {cfg.listen_port}")
    for name in ("heartbeat_interval_s", "health_interval_s", "probe_timeout_s"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")
    for name in ("engine_wait_timeout_s", "drain_timeout_s", "drain_grace_s"):
        if not getattr(cfg, name) >= 0:
            raise ConfigError(f"--{name.removesuffix('_s').replace('_', '-')} must be >= 0")
    if not cfg.replica_ttl_s > cfg.heartbeat_interval_s:
        raise ConfigError("--replica-ttl must be larger than --heartbeat-interval (else entries flap)")
    if cfg.kv_events and cfg.redis_url is None:
        raise ConfigError("--kv-events shares residency through Redis: needs --redis")
    if cfg.unhealthy_after < 1:
        raise ConfigError("--unhealthy-after must be >= 1")
    if cfg.dp_rank is not None and not 0 <= cfg.dp_rank < 1024:
        raise ConfigError(f"--dp-rank must be 0..1023, got {cfg.dp_rank}")
    if cfg.capacity_tokens < 0 or cfg.host_capacity_tokens < 0:
        raise ConfigError("--capacity-tokens/--host-capacity-tokens must be >= 0")
    if not cfg.health_path.startswith("/"):
        raise ConfigError(f"--health-path must start with '/', got {cfg.health_path!r}")
    rid = cfg.replica_id
    if rid and (len(rid) > 200 or any(c.isspace() or c == "/" for c in rid)):
        raise ConfigError(f"--replica-id must be <= 200 chars without spaces or '/', got {rid!r}")
    return AgentConfig(
        **{
            **{f.name: getattr(cfg, f.name) for f in fields(AgentConfig)},
            "engine_url": engine,
            "advertise_url": advertise,
            "gateways": gateways,
        }
    )

"""Gateway configuration: one frozen ``GatewayConfig``, validated once at start-up.

Sources, highest precedence first: command-line flags > ``KVROUTE_*`` environment variables
(nested keys with ``__``: ``KVROUTE_LIMITS__MAX_BODY_BYTES``) > an optional YAML file
(``--config PATH`` or ``KVROUTE_CONFIG``) > defaults. ``load_config(argv, environ)`` reads only what it
is given (the process environment is passed in by ``serve.py``), so tests never touch ``os.environ``.

Every error is a :class:`router.errors.ConfigError` whose message names the key (dotted path, and the
environment variable that sets it), e.g. ``limits.max_body_bytes (KVROUTE_LIMITS__MAX_BODY_BYTES):
Input should be greater than 0``. Unknown keys (in YAML, env or ``--set``) are errors too, so a typo
never silently falls back to a default.

The reference for every key is ``docs/CONFIG.md``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

from router.errors import ConfigError
from router.model import ReplicaSpec, rank_replica_id
from router.observability.logging import redact_url
from router.store.base import StoreConfig
from router.store.url import check_redis_url

__all__ = [
    "DEFAULT_SESSION_HEADERS",
    "ENV_PREFIX",
    "DownstreamConfig",
    "GatewayConfig",
    "HealthConfig",
    "KvEventsSettings",
    "LimitsConfig",
    "StoreSettings",
    "TimeoutsConfig",
    "build_arg_parser",
    "load_config",
    "rank_replica_id",
    "replica_id_from_url",
    "replica_specs",
]

ENV_PREFIX = "KVROUTE_"
# Claude Code (2.1.86 and later) names its session in X-Claude-Code-Session-Id, Codex in session_id
DEFAULT_SESSION_HEADERS = (
    "Modal-Session-Id", "X-Claude-Code-Session-Id", "session_id", "x-session-id", "X-SMG-Routing-Key"
)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
# keys whose value is a credential (or carries one: a Redis URL's password): a start-up error names
# the key, never echoes the value (the redis_url check shows the URL itself, redacted)
_SECRET_KEYS = frozenset({"admin_token", "redis_url"})

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class LimitsConfig(BaseModel):
    """Request limits. Violations get OpenAI-style JSON errors (413, 400)."""

    model_config = _FROZEN

    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    max_field_size: int = Field(16 * 1024, ge=1024)  # one header line (name + value), bytes
    max_line_size: int = Field(16 * 1024, ge=1024)  # request line (method + path), bytes
    max_headers: int = Field(128, ge=8)
    max_session_id_len: int = Field(256, gt=0, le=4096)
    session_id_pattern: str = r"^[A-Za-z0-9._:@/+=~-]+$"

    @field_validator("session_id_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return v


class TimeoutsConfig(BaseModel):
    """Upstream timeouts, seconds. ``first_byte_s`` covers connect + queue + prefill of a cold 100k
    context (several seconds on the reference replica, minutes under overload): keep it generous."""

    model_config = _FROZEN

    connect_s: float = Field(3.0, gt=0)
    first_byte_s: float = Field(600.0, gt=0)
    idle_read_s: float = Field(300.0, gt=0)  # max gap between two chunks of a response
    probe_s: float = Field(2.0, gt=0)  # /health, /metrics, /v1/models probes
    shutdown_s: float = Field(30.0, ge=0)  # graceful shutdown: in-flight requests get this long


class HealthConfig(BaseModel):
    """Discovery: polling of each replica's ``/metrics`` and ``/health``."""

    model_config = _FROZEN

    scrape_interval_s: float = Field(1.0, gt=0)
    health_interval_s: float = Field(1.0, gt=0)
    jitter: float = Field(0.1, ge=0, lt=1)  # each round's period is interval * (1 ± jitter)
    # a health or scrape round starts its replicas' probes evenly over this fraction of its interval,
    # so their answers do not land on the event loop together (0: all at once)
    spread: float = Field(0.8, ge=0, le=0.95)
    unhealthy_threshold: int = Field(3, ge=1)  # consecutive failed checks: ACTIVE -> DOWN
    # a probe that times out counts as failed only when the replica is also failing requests or has
    # shown no sign of life (good probe, answered request) for this long: busy is not dead
    stall_after_s: float = Field(30.0, gt=0)
    healthy_threshold: int = Field(2, ge=1)  # consecutive good checks: DOWN -> ACTIVE
    eject_on_connect_errors: int = Field(1, ge=0)  # passive: consecutive connect errors -> DOWN (0: off)
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    # JSON load report scraped with /metrics for what /metrics lacks (waiting uncached tokens); "" = off
    loads_path: str = "/v1/loads"


class DownstreamConfig(BaseModel):
    """The HTTP server the gateway's clients talk to."""

    model_config = _FROZEN

    # an idle client connection closes after this long; so does one whose request head is not whole
    # this long after the connection opened or its last response
    keepalive_s: float = Field(75.0, gt=0)


class KvEventsSettings(BaseModel):
    """Exact cache residency from the replicas' KV events (docs/KV_EVENTS.md)."""

    model_config = _FROZEN

    # auto: subscribe to every replica whose /server_info advertises a ZMQ publisher (kv_events), when
    # the kvevents extra (pyzmq, msgspec) is installed; subscribe: the same, a missing extra is an
    # error; redis: read what writers (sidecars, or a gateway with publish) share through Redis; off
    mode: Literal["auto", "subscribe", "redis", "off"] = "auto"
    publish: bool = False  # write the residency of the replicas we subscribe to into Redis
    forward_session_id: bool = True  # add the session id to bodies sent to subscribed replicas
    refresh_s: float = Field(5.0, gt=0)  # registry -> subscriptions (new replicas, removed ones)
    replay_timeout_s: float = Field(2.0, gt=0)
    max_blocks_per_replica: int = Field(3_000_000, gt=0)
    max_sessions_per_replica: int = Field(200_000, gt=0)
    flush_s: float = Field(0.05, gt=0)  # publish: how often changes are written
    ttl_s: float = Field(3.0, gt=0)  # publish: a silent writer's replicas expire after this

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        # YAML reads a bare `off` (`mode: off`, `--set kv_events.mode=off`) as false
        return "off" if v is False else v


_STORE_DEFAULTS = StoreConfig()


class StoreSettings(BaseModel):
    """Validated form of :class:`router.store.base.StoreConfig`."""

    model_config = _FROZEN

    session_ttl_s: float = Field(_STORE_DEFAULTS.session_ttl_s, gt=0)
    active_window_s: float = Field(_STORE_DEFAULTS.active_window_s, gt=0)
    ramp_window_s: float = Field(_STORE_DEFAULTS.ramp_window_s, gt=0)
    lease_ttl_s: float = Field(_STORE_DEFAULTS.lease_ttl_s, gt=0)
    replica_ttl_s: float = Field(_STORE_DEFAULTS.replica_ttl_s, gt=0)
    key_prefix: str = Field(_STORE_DEFAULTS.key_prefix, min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    # Redis only: replica-table refresh period of the 2-round-trip fast path (0 = 3-round-trip path);
    # None = $KVROUTE_REDIS_REFRESH_S, else 0.05 s (router.store.redis.gateway_refresh_s)
    replica_refresh_s: float | None = Field(None, ge=0, le=60)

    def to_store_config(self) -> StoreConfig:
        return StoreConfig(**self.model_dump(exclude={"replica_refresh_s"}))


def _default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def replica_id_from_url(url: str) -> str:
    """``host:port`` of a replica URL (the default port of the scheme if none is given)."""
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


def _split_list(v: Any) -> Any:
    """Env and flags give lists as JSON (``["a","b"]``) or comma-separated text (``a,b``)."""
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            try:
                return json.loads(s)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list: {exc.msg}") from None
        return [p.strip() for p in s.split(",") if p.strip()]
    return v


class GatewayConfig(BaseSettings):
    """Everything the gateway needs, frozen. Construct through :func:`load_config`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        validate_default=True,
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0 = any free port (tests)
    replicas: Annotated[tuple[str, ...], NoDecode] = ()
    # each of ``replicas`` is an engine of this many data-parallel ranks (SGLang --dp-size), each
    # rank placed as a replica of its own, ``host:port-dpR`` (docs/REAL_SGLANG.md section 4)
    replica_dp_ranks: int = Field(1, ge=1, le=64)
    policy: str = "kv_aware"
    policy_params: dict[str, Any] = Field(default_factory=dict)
    session_headers: Annotated[tuple[str, ...], NoDecode] = DEFAULT_SESSION_HEADERS
    routing_key_header: str = "x-smg-routing-key"  # "" = do not forward the session id
    decision_headers: bool = True  # X-Kvroute-Replica / X-Kvroute-Reason on responses
    limits: LimitsConfig = Field(default_factory=LimitsConfig)  # type: ignore[arg-type]
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)  # type: ignore[arg-type]
    health: HealthConfig = Field(default_factory=HealthConfig)  # type: ignore[arg-type]
    max_retries: int = Field(2, ge=0, le=10)  # extra attempts after a failure before the first byte
    max_connections: int = Field(1024, ge=1)  # upstream connection pool, all replicas
    max_connections_per_replica: int = Field(0, ge=0)  # 0 = no per-replica cap
    downstream: DownstreamConfig = Field(default_factory=DownstreamConfig)  # type: ignore[arg-type]
    models_cache_s: float = Field(5.0, ge=0)  # GET /v1/models is merged from replicas and cached
    store: StoreSettings = Field(default_factory=StoreSettings)  # type: ignore[arg-type]
    redis_url: str | None = None
    admin_token: SecretStr | None = None
    # operator surface (docs/OPERATIONS.md): no admin_token -> /admin answers 404 unless admin_insecure
    admin_insecure: bool = False  # serve /admin without a token: local demos only
    admin_port: int | None = Field(None, ge=0, le=65535)  # serve /admin on its own port (same host); 0 = free
    admin_networks: Annotated[
        tuple[str, ...], NoDecode
    ] = ()  # POST /admin/replicas URLs; () = loopback+private
    otel: bool = False  # OpenTelemetry tracing (the 'otel' extra); on as well when otel_endpoint is set
    otel_endpoint: str | None = None  # OTLP/HTTP collector base URL, e.g. http://otel-collector:4318
    otel_service_name: str = Field("kvroute-gateway", min_length=1, max_length=128)
    gateway_id: str = Field(default_factory=_default_gateway_id, min_length=1, max_length=128)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    access_log: bool = False
    seed: int | None = None  # routing RNG seed (tie-breaks); None = from the OS
    tls_cert: str | None = None  # PEM certificate (chain) of the listener: HTTPS when set with tls_key
    tls_key: str | None = None  # PEM private key of the listener
    warm_handoff: bool = False  # warm the next home of a draining replica's idle sessions (router/handoff.py)
    # SO_REUSEPORT on the listener: a new gateway binds the port while the old one still serves, so a
    # restart refuses no connection (docs/OPERATIONS.md "Restarting a gateway")
    reuse_port: bool = False
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)  # type: ignore[arg-type]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_config merges the sources itself (with an injected environ): constructing a
        # GatewayConfig never reads os.environ or files behind the caller's back.
        return (init_settings,)

    # ---- field checks ---------------------------------------------------------------------------

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas_list(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        seen: set[str] = set()
        for i, url in enumerate(v):
            url = url.strip().rstrip("/")
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"[{i}] {url!r}: expected http://host:port")
            try:
                port = parts.port
            except ValueError:
                raise ValueError(f"[{i}] {url!r}: bad port") from None
            if port == 0:
                raise ValueError(f"[{i}] {url!r}: bad port (0)")
            if parts.query or parts.fragment or parts.username or parts.password:
                raise ValueError(f"[{i}] {url!r}: no query, fragment or credentials allowed")
            rid = replica_id_from_url(url)
            if rid in seen:
                raise ValueError(f"[{i}] {url!r}: duplicate replica {rid}")
            seen.add(rid)
            out.append(url)
        return tuple(out)

    @field_validator("session_headers", mode="before")
    @classmethod
    def _headers_list(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("session_headers")
    @classmethod
    def _header_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("at least one header name is required")
        for name in v:
            if not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid header name")
        return v

    @field_validator("routing_key_header")
    @classmethod
    def _routing_header(cls, v: str) -> str:
        if v and not _HEADER_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid header name")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        assert v is not None
        return check_redis_url(v)  # the sidecar's check too; its message shows the URL redacted

    @field_validator("admin_networks", mode="before")
    @classmethod
    def _networks_list(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("admin_networks")
    @classmethod
    def _networks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for i, net in enumerate(v):
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"[{i}] {net!r}: expected a network like 10.0.0.0/8") from None
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewayConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: tls_cert and tls_key must be given together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: {path!r} is not a readable file")
        return self

    @model_validator(mode="after")
    def _kv_events_redis(self) -> GatewayConfig:
        kv = self.kv_events
        if kv.mode == "redis" and self.redis_url is None:
            raise ValueError("kv_events.mode: 'redis' reads residency shared through Redis: set redis_url")
        if kv.publish and (self.redis_url is None or kv.mode not in ("auto", "subscribe")):
            raise ValueError("kv_events.publish: needs redis_url and kv_events.mode auto or subscribe")
        return self

    @field_validator("otel_endpoint")
    @classmethod
    def _otel_endpoint(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        assert v is not None
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r}: expected http(s)://host:port of an OTLP/HTTP collector")
        return v.rstrip("/")

    @field_validator("policy_params", mode="before")
    @classmethod
    def _params_json(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc.msg}") from None
        return v

    @model_validator(mode="after")
    def _policy_checks(self) -> GatewayConfig:
        from router.policy.params import PolicyParams  # pure module, no I/O

        try:
            PolicyParams.from_dict(self.policy_params)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"policy_params.{exc}") from None
        names = _policy_names()
        if names is not None and self.policy not in names:
            raise ValueError(
                f"policy: unknown policy {self.policy!r} (choose from {', '.join(sorted(names))})"
            )
        return self

    # ---- derived ----------------------------------------------------------------------------------

    def replica_specs(self) -> tuple[ReplicaSpec, ...]:
        return replica_specs(self.replicas, self.replica_dp_ranks)

    def policy_params_obj(self) -> Any:
        """The validated ``PolicyParams``."""
        from router.policy.params import PolicyParams

        return PolicyParams.from_dict(self.policy_params)


def replica_specs(urls: Sequence[str], dp_ranks: int = 1) -> tuple[ReplicaSpec, ...]:
    """The static replicas: one per URL, or with ``dp_ranks`` > 1 one per data-parallel rank of each
    URL's engine (``rank_replica_id``)."""
    if dp_ranks == 1:
        return tuple(ReplicaSpec(id=replica_id_from_url(u), url=u.rstrip("/"), source="static") for u in urls)
    return tuple(
        ReplicaSpec(id=rank_replica_id(replica_id_from_url(u), r), url=u.rstrip("/"), source="static", dp_rank=r)
        for u in urls
        for r in range(dp_ranks)
    )


def _policy_names() -> frozenset[str] | None:
    """Policy names known to the registry (None if the registry cannot be imported)."""
    try:
        from router.policy import registry
    except ImportError:
        return None
    names = getattr(registry, "POLICY_NAMES", None) or getattr(registry, "POLICIES", None)
    if names is None:
        return None
    return frozenset(names)


# ---- sources ------------------------------------------------------------------------------------


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' env source over an injected mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = dict(environ)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


def _check_env_keys(environ: Mapping[str, str]) -> None:
    """Catch typos in ``KVROUTE_*`` variables without tripping over other tools' variables.

    Other parts of kvroute read ``KVROUTE_SIDECAR_*``, ``KVROUTE_MODEL_PATH``, ``KVROUTE_VENV`` ...
    from the same environment, so an unknown top-level name is ignored, unless it is a near miss
    of one of our keys (``KVROUTE_PROT``). A nested name (``KVROUTE_A__B``) whose section is ours
    must name a real sub-key.
    """
    fields = list(GatewayConfig.model_fields)
    for name in environ:
        if not name.upper().startswith(ENV_PREFIX) or name.upper() == f"{ENV_PREFIX}CONFIG":
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in GatewayConfig.model_fields:
            close = difflib.get_close_matches(path[0], fields, n=1, cutoff=0.75)
            if close:
                raise ConfigError(
                    f"{name}: unknown configuration key {path[0]!r} (did you mean {close[0]!r}?)"
                )
            continue  # someone else's variable
        model: type[BaseModel] = GatewayConfig
        for i, part in enumerate(path):
            field = model.model_fields.get(part)
            if field is None:
                raise ConfigError(f"{name}: unknown configuration key {'.'.join(path[: i + 1])!r}")
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel) and i + 1 < len(path):
                model = ann
            elif i + 1 < len(path) and part != "policy_params":
                raise ConfigError(f"{name}: {part!r} has no sub-keys")
            else:
                break


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    _check_env_keys(environ)
    try:
        return dict(_MappingEnvSource(GatewayConfig, environ)())
    except Exception as exc:  # pydantic-settings raises SettingsError/ValueError naming the field
        raise ConfigError(f"environment: {exc}") from exc


def _yaml_values(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def build_arg_parser(prog: str = "kvroute serve") -> argparse.ArgumentParser:
    """Flags of ``kvroute serve``. Only flags given on the command line override other sources."""
    p = argparse.ArgumentParser(
        prog=prog, description="Run the kvroute gateway.", argument_default=argparse.SUPPRESS
    )
    p.add_argument("--config", metavar="PATH", help="YAML file with any of the keys of docs/CONFIG.md")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000; 0 = any free port)")
    p.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        metavar="URL",
        help="replica base URL, e.g. http://10.0.0.5:30000 (repeatable)",
    )
    p.add_argument(
        "--replica-dp-ranks",
        type=int,
        metavar="N",
        help="each --replica is an engine of N data-parallel ranks (SGLang --dp-size N), each placed as a replica",
    )
    p.add_argument("--policy", help=_policy_help())
    p.add_argument(
        "--policy-param",
        dest="policy_param",
        action="append",
        metavar="KEY=VALUE",
        help="a policy parameter (repeatable), e.g. --policy-param thicc_threshold=4",
    )
    p.add_argument(
        "--session-header",
        dest="session_headers",
        action="append",
        metavar="NAME",
        help="header carrying the session id (repeatable; replaces the default list)",
    )
    p.add_argument("--routing-key-header", help="header the session id is forwarded under ('' = off)")
    p.add_argument(
        "--no-decision-headers",
        dest="decision_headers",
        action="store_false",
        help="do not add X-Kvroute-Replica / X-Kvroute-Reason to responses",
    )
    p.add_argument("--max-retries", type=int)
    p.add_argument("--redis", "--redis-url", dest="redis_url", metavar="URL", help="shared state in Redis")
    p.add_argument(
        "--admin-token", metavar="TOKEN", help="bearer token of the /admin API (or KVROUTE_ADMIN_TOKEN)"
    )
    p.add_argument("--admin-port", type=int, help="serve /admin on this port instead of the gateway's")
    p.add_argument(
        "--admin-insecure",
        action="store_true",
        default=argparse.SUPPRESS,
        help="serve /admin without a token (local demos only)",
    )
    p.add_argument("--otel", action="store_true", default=argparse.SUPPRESS, help="OpenTelemetry tracing on")
    p.add_argument("--otel-endpoint", metavar="URL", help="OTLP/HTTP collector, e.g. http://127.0.0.1:4318")
    p.add_argument(
        "--warm-handoff",
        action="store_true",
        default=argparse.SUPPRESS,
        help="while a replica drains, pre-warm its idle sessions' next home (docs/DEPLOY.md)",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        default=argparse.SUPPRESS,
        help="SO_REUSEPORT: start the next gateway on the same port before stopping this one (no refused connections)",
    )
    p.add_argument("--gateway-id")
    p.add_argument("--log-level")
    p.add_argument("--access-log", action="store_true", default=argparse.SUPPRESS)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--tls-cert", dest="tls_cert", metavar="PATH", help="PEM certificate: serve HTTPS (with --tls-key)"
    )
    p.add_argument("--tls-key", dest="tls_key", metavar="PATH", help="PEM private key of --tls-cert")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        metavar="KEY=VALUE",
        help="any key by dotted path, e.g. --set limits.max_body_bytes=1048576 (value parsed as YAML)",
    )
    return p


def _policy_help() -> str:
    """The ``--policy`` choices, from the registry (router.policy.registry.POLICIES): never a
    hand-kept list that drifts from what the gateway accepts."""
    default = GatewayConfig.model_fields["policy"].default
    names = sorted(_policy_names() or ())
    others = [n for n in names if n != default]
    return ", ".join([f"{default} (default)", *others])


def _set_path(out: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    parts = [p for p in dotted.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"{origin}: empty key")
    node = out
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{origin}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _cli_values(argv: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    ns = vars(build_arg_parser().parse_args(list(argv)))
    config_path: str | None = ns.pop("config", None)
    out: dict[str, Any] = {}
    for item in ns.pop("policy_param", []):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--policy-param {item!r}: expected KEY=VALUE")
        out.setdefault("policy_params", {})[key.strip()] = yaml.safe_load(raw)
    for item in ns.pop("overrides", []):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        _set_path(out, key, yaml.safe_load(raw) if raw else "", f"--set {key}")
    out.update(ns)
    return out, config_path


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "policy_params":
            out[k] = _deep_merge(dict(out[k]), v)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}  # policy params merge key by key
        else:
            out[k] = v
    return out


def _env_name(loc: Sequence[Any]) -> str:
    keys = [str(p) for p in loc if isinstance(p, str)]
    return ENV_PREFIX + "__".join(k.upper() for k in keys)


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"]]
        dotted = ".".join(str(p) for p in loc) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if not loc and ":" in msg:  # model-level checks already name their key ("policy: ...")
            lines.append(msg)
            continue
        where = f"{dotted} ({_env_name(loc)})" if loc else dotted
        got = err.get("input")
        suffix = (
            f" (got {got!r})"
            if loc
            and loc[0] not in _SECRET_KEYS
            and not isinstance(got, dict | list | tuple)
            and got is not None
            else ""
        )
        lines.append(f"{where}: {msg}{suffix}")
    return redact_url("invalid configuration: " + "; ".join(lines))


def load_config(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Build the frozen config from flags, ``KVROUTE_*`` env and an optional YAML file.

    Raises :class:`ConfigError` naming the offending key. ``argparse`` handles ``--help`` and
    unknown flags itself (``SystemExit``).
    """
    env = dict(environ or {})
    cli, config_path = _cli_values(argv)
    config_path = config_path or env.get(f"{ENV_PREFIX}CONFIG") or None
    merged: dict[str, Any] = _yaml_values(config_path) if config_path else {}
    merged = _deep_merge(merged, _env_values(env))
    merged = _deep_merge(merged, cli)
    try:
        return GatewayConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None

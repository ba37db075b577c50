"""Admin REST sub-app (``/admin``): stats, replicas, drain, sessions, live policy config, dashboard.

Rules:
  1. Auth: ``Authorization: Bearer <token>`` compared with ``hmac.compare_digest``. No token
     configured -> the whole admin API answers 404 (disabled) unless ``insecure=True`` (local demos
     only). The dashboard page may also be opened once with ``?token=``; that sets an HttpOnly,
     SameSite=Strict cookie which is accepted for *read-only* (GET) requests only, so a browser
     session can never mutate anything without the bearer header.
  2. Every error is OpenAI-style JSON ``{"error": {"message", "type", "code"}}`` with the right status.
  3. ``PATCH /admin/config`` validates through ``PolicyParams.with_changes`` and swaps the policy the
     gateway routes with atomically (:class:`PolicyHolder` *is* the gateway's policy object and
     delegates to the current one), so the next decision already uses the new parameters.
  4. Replica URLs registered here must be http(s) and resolve into the allowed networks (default
     loopback + private ranges), so the admin API cannot be used to aim the gateway anywhere else.
  5. The shape of every endpoint is in ``admin_openapi.py`` (served at ``/admin/openapi.json``); a
     schemathesis test checks the implementation against it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from router.clock import Clock
from router.errors import BadRequestError, KvrouteError, NotFoundError, UnauthorizedError, error_body
from router.model import (
    ClusterSnapshot,
    HealthStamp,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
)
from router.observability.stats import RollingStats
from router.policy.base import Policy
from router.policy.kv_aware import cache_surely_gone, residency_horizon
from router.policy.params import PolicyParams
from router.residency import OFF, with_residency
from router.store.base import StateStore

log = logging.getLogger("kvroute.admin")

__all__ = [
    "ADMIN_COOKIE",
    "DEFAULT_ALLOWED_NETWORKS",
    "AdminSettings",
    "PolicyHolder",
    "make_admin_app",
    "replica_view",
    "residency_view",
    "validate_replica_url",
]

ADMIN_COOKIE = "kvroute_admin"

DEFAULT_ALLOWED_NETWORKS: tuple[str, ...] = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",  # carrier-grade NAT range some CNIs use for pod IPs
    "fc00::/7",
)

_MAX_BODY = 64 * 1024
SESSIONS_BOUND_CAP = 10_000  # /admin/stats reports at most this many bound sessions per replica
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:[]")


# ---- the swappable policy --------------------------------------------------------------------------


class PolicyHolder:
    """A ``Policy`` that delegates to the current one; the admin API swaps it live.

    Give this object to ``make_app`` as the gateway's policy. ``replace`` builds the new policy first
    and swaps one reference, so a request in flight routes with either the old or the new policy,
    never a half-updated one (asyncio: no await in between).
    """

    def __init__(
        self,
        name: str,
        params: PolicyParams,
        factory: Callable[[str, PolicyParams], Policy] | None = None,
        *,
        initial: Policy | None = None,
    ) -> None:
        if factory is None:
            from router.policy.registry import make_policy

            factory = make_policy
        self._factory = factory
        self.name = name
        self._params = params
        # ``initial``: adopt a policy the gateway already built (same name and params)
        self._policy = initial if initial is not None else factory(name, params)
        self.generation = 0
        self.shared_generation = 0  # of the store's shared config last installed (0: none)

    @property
    def params(self) -> PolicyParams:
        return self._params

    @property
    def current(self) -> Policy:
        return self._policy

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        return self._policy.route(request, snapshot, rng)

    def replace(self, name: str | None = None, changes: Mapping[str, Any] | None = None) -> PolicyParams:
        """Validate and apply; raises ``ValueError`` naming the bad key and changes nothing then."""
        prepared = self.prepare(name, changes)
        self.install(prepared)
        return prepared[1]

    def prepare(
        self, name: str | None = None, changes: Mapping[str, Any] | None = None
    ) -> tuple[str, PolicyParams, Policy]:
        """The policy ``replace`` would install, built and validated (``ValueError``), not installed."""
        new_name = self.name if name is None else name
        new_params = self._params.with_changes(**dict(changes or {}))
        return new_name, new_params, self._factory(new_name, new_params)  # ValueError: unknown policy

    def install(self, prepared: tuple[str, PolicyParams, Policy]) -> None:
        """One assignment each, no await: a decision sees the old policy or the new one."""
        self.name, self._params, self._policy = prepared
        self.generation += 1

    @staticmethod
    def config_doc(prepared: tuple[str, PolicyParams, Policy]) -> str:
        """What ``StateStore.share_config`` carries: the whole config, not the change."""
        return json.dumps({"policy": prepared[0], "params": prepared[1].to_dict()}, separators=(",", ":"))

    def __getattr__(self, item: str) -> Any:
        # policy-specific extras (e.g. an ``observe`` hook) stay reachable through the holder
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self._policy, item)


async def follow_shared_config(store: StateStore, holder: PolicyHolder, interval_s: float) -> None:
    """Install the policy config another gateway shared (``PATCH /admin/config``) as it changes, the
    first time at start: every gateway of a store routes with the last one patched. One cheap read
    per ``interval_s`` (the document only when its generation moved). A document this gateway
    cannot install (a newer version's parameter) is logged and skipped until the next change."""
    while True:
        gen, doc = await store.shared_config(holder.shared_generation)
        if doc is not None and gen != holder.shared_generation:
            try:
                data = json.loads(doc)
                if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
                    raise TypeError("expected {policy, params: {...}}")
                holder.install(holder.prepare(data["policy"], data["params"]))
                log.info("policy config generation %d installed from the shared store", gen)
            except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
                log.warning("shared policy config generation %d not installed: %s", gen, str(exc)[:200])
            holder.shared_generation = gen
        await asyncio.sleep(interval_s)


# ---- settings and pure views ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdminSettings:
    token: str | None = None
    insecure: bool = False  # serve the admin API without a token (local demo only)
    allowed_networks: tuple[str, ...] = DEFAULT_ALLOWED_NETWORKS
    resolve_timeout_s: float = 1.0
    extra_status: Callable[[], Mapping[str, Any]] | None = field(default=None, compare=False)

    @property
    def enabled(self) -> bool:
        return bool(self.token) or self.insecure


def residency_view(session: SessionState, home: ReplicaState | None, params: PolicyParams) -> dict[str, Any]:
    """How likely the session's prefix is still cached on its home: the policy's own rule 6
    (``kv_aware.cache_surely_gone``), so the view and the routing agree.

    ``pressure`` = tokens written into the home's cache since this session last wrote there, over
    the home's residency horizon (``kv_aware.residency_horizon``: what the engine's answers showed,
    else HBM + host tier); above 1 the policy treats the prefix as gone.
    """
    if home is None or session.home is None:
        return {
            "estimate": "unknown",
            "tokens_written_since": None,
            "capacity_tokens": None,
            "pressure": None,
        }
    horizon = residency_horizon(home, params)
    since = max(0, home.tokens_written - session.residency_mark) if session.residency_mark else None
    if since is None:
        return {"estimate": "unknown", "tokens_written_since": None, "capacity_tokens": round(horizon),
                "pressure": None}  # fmt: skip
    pressure = since / horizon if horizon > 0 else None
    estimate = "likely_evicted" if cache_surely_gone(session, home, params) else "resident"
    return {
        "estimate": estimate,
        "tokens_written_since": since,
        "capacity_tokens": round(horizon),
        "pressure": None if pressure is None else round(pressure, 6),
    }


def replica_view(
    r: ReplicaState,
    now: float,
    *,
    sessions_bound: int | None = None,
    breaks: int = 0,
    residency_source: str = "off",
    health: HealthStamp | None = None,
) -> dict[str, Any]:
    e = r.engine
    return {
        "id": r.id,
        "url": r.url,
        "status": r.status.value,
        "model": r.model,
        "dp_rank": r.dp_rank,
        "in_flight": r.in_flight,
        "sessions_bound": sessions_bound,
        "sessions_active": r.sessions_active,
        "active_context_tokens": r.active_context_tokens,
        "capacity_tokens": r.capacity_tokens,
        "host_capacity_tokens": r.host_capacity_tokens,
        "kv_util": round(e.kv_util, 6),
        "running": e.running,
        "queued": e.queued,
        "engine_cache_hit_rate": round(e.cache_hit_rate, 6),
        "engine_age_s": None if e.updated_at <= 0 else round(max(0.0, now - e.updated_at), 3),
        # who probes it (discovery rules 6-8): the gateway that scraped the figures (None: its sidecar
        # reported them, or nobody yet) and the last good health check someone shared
        "engine_reported_by": e.reported_by or None,
        "health_checked_by": None if health is None else health.by,
        "health_check_age_s": None if health is None else round(max(0.0, now - health.at), 3),
        "tokens_written": r.tokens_written,
        # rule 6 feedback: tokens written after which a session's cache was last seen gone here (0: none yet)
        "residency_horizon_tokens": r.residency_horizon_tokens,
        "placed_recent": r.placed_recent,
        "affinity_breaks": breaks,
        # exact residency from KV events (docs/KV_EVENTS.md): events (complete), estimate, off
        "residency_source": residency_source,
    }


def _exact_residency(s: SessionState, view: Any) -> dict[str, Any]:
    """What the KV events say about a session: tokens on its home (``None``: not known exactly) and
    on every replica known to hold some of it."""
    if view is not None:
        s = with_residency(s, view)
    return {"home_tokens": s.resident_tokens, "on": dict(s.resident_on)}


def _load_histogram(loads: Iterable[int]) -> dict[str, int]:
    c = Counter(loads)
    return {str(k): c[k] for k in sorted(c)}


async def validate_replica_url(
    url: str, allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network], timeout_s: float
) -> str:
    """Return the normalised base URL or raise ``BadRequestError`` (http(s), allowed networks only)."""
    if not isinstance(url, str) or len(url) > 2048:
        raise BadRequestError("url: must be a string of at most 2048 characters")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise BadRequestError(f"url: not a valid URL ({exc})") from None
    if parts.scheme not in {"http", "https"}:
        raise BadRequestError("url: scheme must be http or https")
    if port == 0:  # nothing listens there, and the id would read as the scheme's default port
        raise BadRequestError("url: port must be 1-65535")
    host = parts.hostname
    if not host:
        raise BadRequestError("url: missing host")
    if parts.username or parts.password:
        raise BadRequestError("url: credentials in the URL are not allowed")
    if parts.query or parts.fragment or parts.path not in {"", "/"}:
        raise BadRequestError("url: must be a base URL (no path, query or fragment)")
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        if not all(c.isalnum() or c in "-." for c in host) or len(host) > 253:
            raise BadRequestError("url: invalid host name") from None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                infos = await loop.getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError):
            raise BadRequestError(f"url: host {host!r} does not resolve") from None
        addrs = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for a in addrs:
        if not any(a in net for net in allowed if net.version == a.version):
            raise BadRequestError(f"url: address {a} is not in the allowed networks")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme}://{netloc}"


# ---- the app ---------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(error_body(message, type_, code), status=status)


def _kv_error(exc: KvrouteError) -> web.Response:
    return _error(exc.status, str(exc) or exc.code, exc.code, exc.error_type)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > _MAX_BODY:
        raise BadRequestError(f"body: larger than {_MAX_BODY} bytes")
    raw = await request.content.read(_MAX_BODY + 1)
    if len(raw) > _MAX_BODY:
        raise BadRequestError(f"body: larger than {_MAX_BODY} bytes")
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over the digit limit
        raise BadRequestError(f"body: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequestError("body: expected a JSON object")
    return data


def _path_id(request: web.Request, name: str) -> str:
    val = request.match_info[name]
    if not val or len(val) > 256 or not set(val) <= _ID_CHARS:
        raise BadRequestError(f"{name}: invalid id")
    return val


def _credential_bytes(value: str) -> bytes:
    """A client-sent credential as bytes for ``hmac.compare_digest``. aiohttp decodes header bytes
    that are not UTF-8 into lone surrogates, which a strict ``encode()`` refuses (that was an
    unauthenticated 500); ``surrogatepass`` encodes any string, and such bytes never equal the token."""
    return value.encode("utf-8", "surrogatepass")


def _int_field(data: Mapping[str, Any], key: str, default: int = 0) -> int:
    if key not in data:
        return default
    val = data[key]
    if isinstance(val, bool) or not isinstance(val, int) or val < 0 or val > 10**12:
        raise BadRequestError(f"{key}: expected a non-negative integer")
    return val


def make_admin_app(
    store: StateStore,
    holder: PolicyHolder,
    stats: RollingStats,
    clock: Clock,
    settings: AdminSettings,
    kv_events: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:
    """The ``/admin`` sub-app; mount it with ``app.add_subapp("/admin", make_admin_app(...))``.
    ``kv_events``: what ``GET /admin/kv-events`` shows (the gateway's ``ResidencyService.stats``)."""
    from router.gateway.admin_openapi import openapi_spec

    token = (settings.token or "").encode()
    # the dashboard cookie carries a value derived from the token, never the token itself: a leaked
    # cookie grants reads only and does not reveal the bearer credential
    cookie_value = hmac.new(token, b"kvroute-admin-ui-cookie", hashlib.sha256).hexdigest().encode()
    networks = tuple(ipaddress.ip_network(n, strict=False) for n in settings.allowed_networks)
    spec_bytes = json.dumps(openapi_spec(), indent=1).encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not settings.enabled:
            return _error(404, "the admin API is disabled (no admin token configured)", "not_found")
        if token:
            if (
                request.path.rstrip("/") == "/admin/ui"
                and request.method == "GET"
                and "token" in request.query
            ):
                if not hmac.compare_digest(_credential_bytes(request.query["token"]), token):
                    return _kv_error(UnauthorizedError("invalid admin token"))
                rest = {k: v for k, v in request.query.items() if k != "token"}
                location = str(request.rel_url.with_path("/admin/ui").with_query(rest))
                resp = web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})
                resp.set_cookie(
                    ADMIN_COOKIE,
                    cookie_value.decode(),
                    httponly=True,
                    samesite="Strict",
                    path="/admin",
                    secure=request.secure,
                )
                return resp
            auth = request.headers.get("Authorization", "")
            scheme, _, cred = auth.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(_credential_bytes(cred.strip()), token)
            if not ok and request.method in {"GET", "HEAD"}:
                cookie = request.cookies.get(ADMIN_COOKIE)
                ok = cookie is not None and hmac.compare_digest(_credential_bytes(cookie), cookie_value)
            if not ok:
                resp401 = _kv_error(
                    UnauthorizedError("missing admin token" if not auth else "invalid admin token")
                )
                resp401.headers["WWW-Authenticate"] = 'Bearer realm="kvroute-admin"'
                return resp401
        try:
            return await handler(request)
        except KvrouteError as exc:
            return _kv_error(exc)
        except web.HTTPMethodNotAllowed as exc:
            resp405 = _error(405, f"method {request.method} not allowed here", "method_not_allowed")
            resp405.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return resp405
        except web.HTTPNotFound:
            return _error(404, f"no admin route {request.path}", "not_found")
        except web.HTTPException:
            raise

    async def _view(r: ReplicaState, now: float, stamps: Mapping[ReplicaId, HealthStamp]) -> dict[str, Any]:
        # counting bound sessions walks them in the store: capped so a poll stays cheap
        bound = len(await store.sessions_on(r.id, limit=SESSIONS_BOUND_CAP))
        view = getattr(store, "residency", None)
        source = OFF if view is None else view.source(r.id)
        return replica_view(r, now, sessions_bound=bound, breaks=stats.breaks_for(r.id), residency_source=source,
                            health=stamps.get(r.id))  # fmt: skip

    async def get_stats(request: web.Request) -> web.Response:
        now = clock.now()
        reps = await store.replicas()
        stamps = await store.health_stamps()
        views = list(await asyncio.gather(*(_view(r, now, stamps) for r in reps)))
        active = [r for r in reps if r.status is ReplicaStatus.ACTIVE]
        loads = [r.in_flight for r in active]
        fleet = stats.view(now, loads_now=loads)
        fd = fleet.to_dict()
        series = fd.pop("series")
        deg_attr = getattr(store, "degraded", None)
        deg_total = getattr(store, "degraded_total", None)
        params = holder.params
        eligible = len(active)
        degradation: dict[str, Any] = {
            "store_degraded": deg_attr if isinstance(deg_attr, bool) else False,
            "store_degraded_total": deg_total if isinstance(deg_total, int) else 0,
            "replicas_down": sum(1 for r in reps if r.status is ReplicaStatus.DOWN),
            "replicas_draining": sum(1 for r in reps if r.status is ReplicaStatus.DRAINING),
            "no_active_replicas": eligible == 0,
            "panic": bool(reps) and eligible < params.panic_threshold * len(reps),
        }
        if settings.extra_status is not None:
            degradation.update(settings.extra_status())
        body = {
            "now": now,
            "policy": holder.name,
            "policy_generation": holder.generation,
            "replicas": views,
            "fleet": {
                "replicas": len(reps),
                "replicas_active": eligible,
                "in_flight": sum(r.in_flight for r in reps),
                "sessions_active": sum(r.sessions_active for r in reps),
                "load_histogram": _load_histogram(loads),
                **fd,
            },
            "degradation": degradation,
            "series": series,
        }
        return web.json_response(body)

    async def list_replicas(request: web.Request) -> web.Response:
        now = clock.now()
        reps = await store.replicas()
        stamps = await store.health_stamps()
        return web.json_response({"replicas": list(await asyncio.gather(*(_view(r, now, stamps) for r in reps)))})

    async def _find(rid: str) -> ReplicaState:
        for r in await store.replicas():
            if r.id == rid:
                return r
        raise NotFoundError(f"replica {rid!r} not found")

    async def upsert_replica(request: web.Request) -> web.Response:
        from router.config import rank_replica_id, replica_id_from_url

        data = await _json_body(request)
        unknown = set(data) - {
            "id",
            "url",
            "model",
            "capacity_tokens",
            "host_capacity_tokens",
            "tp_size",
            "dp_rank",
            "status",
        }
        if unknown:
            raise BadRequestError(f"{min(unknown)}: unknown field")
        if "url" not in data:
            raise BadRequestError("url: required")
        url = await validate_replica_url(data["url"], networks, settings.resolve_timeout_s)
        dp_rank: int | None = None
        if data.get("dp_rank") is not None:
            dp_rank = _int_field(data, "dp_rank")
            if dp_rank > 1023:
                raise BadRequestError("dp_rank: expected an integer from 0 to 1023")
        rid = data["id"] if "id" in data else replica_id_from_url(url)
        if "id" not in data and dp_rank is not None:
            rid = rank_replica_id(rid, dp_rank)
        if not isinstance(rid, str) or not rid or len(rid) > 256 or not set(rid) <= _ID_CHARS:
            raise BadRequestError("id: 1-256 characters of [A-Za-z0-9-_.:[]]")
        model = data.get("model", "")
        if not isinstance(model, str) or len(model) > 256:
            raise BadRequestError("model: expected a string of at most 256 characters")
        status: ReplicaStatus | None = None
        if "status" in data:
            try:
                status = ReplicaStatus(data["status"])
            except ValueError:
                raise BadRequestError(f"status: one of {', '.join(s.value for s in ReplicaStatus)}") from None
        spec = ReplicaSpec(
            id=rid,
            url=url,
            model=model,
            capacity_tokens=_int_field(data, "capacity_tokens"),
            host_capacity_tokens=_int_field(data, "host_capacity_tokens"),
            tp_size=_int_field(data, "tp_size"),
            source="admin",
            dp_rank=dp_rank,
        )
        existed = any(r.id == rid for r in await store.replicas())
        await store.upsert_replica(spec, status)
        rep = await _find(rid)
        stamps = await store.health_stamps()
        return web.json_response(await _view(rep, clock.now(), stamps), status=200 if existed else 201)

    async def drain_replica(request: web.Request) -> web.Response:
        rid = _path_id(request, "replica_id")
        await _find(rid)
        await store.set_status(rid, ReplicaStatus.DRAINING)
        return web.json_response(await _view(await _find(rid), clock.now(), await store.health_stamps()))

    async def delete_replica(request: web.Request) -> web.Response:
        rid = _path_id(request, "replica_id")
        await _find(rid)
        await store.remove_replica(rid)
        return web.json_response({"id": rid, "removed": True})

    async def get_session(request: web.Request) -> web.Response:
        sid = request.match_info["session_id"]
        if not sid or len(sid) > 256:
            raise BadRequestError("session_id: 1-256 characters")
        s = await store.session(sid)
        if s is None:
            raise NotFoundError(f"session {sid!r} not found")
        now = clock.now()
        reps = {r.id: r for r in await store.replicas()}
        home = reps.get(s.home) if s.home else None
        return web.json_response(
            {
                "session_id": s.session_id,
                "home": s.home,
                "home_status": None if home is None else home.status.value,
                "overflow": list(s.overflow),
                "in_flight": {rid: n for rid, n in s.in_flight},
                "in_flight_total": s.in_flight_total,
                "context_tokens": s.context_tokens,
                "turns": s.turns,
                "last_seen_s_ago": round(max(0.0, now - s.last_seen), 3),
                "residency": residency_view(s, home, holder.params),
                "resident_exact": _exact_residency(s, getattr(store, "residency", None)),
            }
        )

    def _config_body() -> dict[str, Any]:
        return {
            "policy": holder.name,
            "params": holder.params.to_dict(),
            "generation": holder.generation,
            "shared_generation": holder.shared_generation,
        }

    async def get_config(request: web.Request) -> web.Response:
        return web.json_response(_config_body())

    async def get_kv_events(request: web.Request) -> web.Response:
        return web.json_response(kv_events() if kv_events is not None else {"mode": "off"})

    async def patch_config(request: web.Request) -> web.Response:
        data = await _json_body(request)
        unknown = set(data) - {"policy", "params"}
        if unknown:
            raise BadRequestError(f"{min(unknown)}: unknown field (expected policy, params)")
        name = data.get("policy")
        if "policy" in data and not isinstance(name, str):
            raise BadRequestError("policy: expected a string")
        changes = data.get("params", {})
        if not isinstance(changes, dict):
            raise BadRequestError("params: expected an object")
        try:
            prepared = holder.prepare(name, changes)
        except (ValueError, TypeError, OverflowError) as exc:
            msg = str(exc)
            raise BadRequestError(msg if ":" in msg else f"params: {msg}") from None
        # shared first (every gateway of the store follows it), then installed here: a store that
        # cannot take it is a 503 and nothing changes anywhere
        doc = holder.config_doc(prepared)
        generation = await store.share_config(doc)
        holder.install(prepared)
        holder.shared_generation = generation
        log.info("policy config generation %d shared: %s", generation, doc)
        return web.json_response(_config_body())

    async def get_openapi(request: web.Request) -> web.Response:
        return web.Response(body=spec_bytes, content_type="application/json")

    async def get_ui(request: web.Request) -> web.Response:
        html = resources.files("router.gateway").joinpath("static/dashboard.html").read_bytes()
        return web.Response(
            body=html,
            content_type="text/html",
            headers={
                "Cache-Control": "no-store",
                "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; img-src 'self' data:; connect-src 'self'",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )

    app = web.Application(middlewares=[guard])
    r = app.router
    r.add_get("/stats", get_stats)
    r.add_get("/replicas", list_replicas)
    r.add_post("/replicas", upsert_replica)
    r.add_post("/replicas/{replica_id}/drain", drain_replica)
    r.add_delete("/replicas/{replica_id}", delete_replica)
    r.add_get("/sessions/{session_id}", get_session)
    r.add_get("/config", get_config)
    r.add_get("/kv-events", get_kv_events)
    r.add_patch("/config", patch_config)
    r.add_get("/openapi.json", get_openapi)
    r.add_get("/ui", get_ui)
    return app

"""The operator surface wired together: metrics + rolling stats + autoscale signal + tracing + admin.

Usage (what ``kvroute serve`` does)::

    surface = operator_surface_from_config(config)
    gw = await start_gateway(config, extra_setup=(surface.setup,))

``setup(app)`` mounts ``/admin`` (sub-app) and ``GET /metrics``, counts every response, adds
tracing (server spans around the gateway middleware, client spans on upstream requests), and runs
the fleet sampler (dispersion/CHR time series and the autoscale EWMA) as a ``cleanup_ctx`` task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.autoscale import AutoscaleConfig, AutoscaleSample, AutoscaleState, desired_replicas, observe
from router.clock import Clock
from router.errors import KvrouteError
from router.eventloop import stop_tasks
from router.events import (
    AffinityBroken,
    Event,
    Hook,
    RequestFinished,
    RequestRouted,
    ResidencyJudged,
    UpstreamRetry,
)
from router.gateway.admin import (
    DEFAULT_ALLOWED_NETWORKS,
    AdminSettings,
    PolicyHolder,
    follow_shared_config,
    make_admin_app,
)
from router.handoff import HANDOFF_KEY
from router.model import ReplicaState, ReplicaStatus
from router.observability.metrics import CONTENT_TYPE, GatewayMetrics
from router.observability.stats import RollingStats
from router.observability.tracing import NOOP_TRACING, Tracing, decision_attributes, make_tracing
from router.policy.params import PolicyParams
from router.store.base import StateStore

if TYPE_CHECKING:
    from router.config import GatewayConfig

log = logging.getLogger("kvroute.observability")

SHARED_CONFIG_POLL_S = 2.0
"""How often a gateway reads the store's shared policy config generation (one small read; a PATCH
through another gateway reaches this one within it)."""

__all__ = [
    "FleetSampler",
    "OperatorSurface",
    "StatsHook",
    "TracingHook",
    "make_operator_surface",
    "operator_surface_from_config",
]


class StatsHook:
    """Feeds :class:`RollingStats` from the gateway's events (event times are on the store clock)."""

    def __init__(self, stats: RollingStats) -> None:
        self.stats = stats

    def __call__(self, event: Event) -> None:
        st = self.stats
        if isinstance(event, RequestRouted):
            st.record_decision(event.at, event.reason.value)
        elif isinstance(event, RequestFinished):
            st.record_finished(
                event.at,
                status=str(event.status),
                prompt_tokens=None if event.usage_estimated else event.prompt_tokens,
                cached_tokens=event.cached_tokens,
            )
        elif isinstance(event, AffinityBroken):
            st.record_break(event.at, event.reason.value, event.replica_id)
        elif isinstance(event, ResidencyJudged):
            st.record_residency_outcome(event.at, event.residency, event.found)
        elif isinstance(event, UpstreamRetry):
            st.record_retry(event.at)


class TracingHook:
    """Writes each routing decision onto the current request span (the event fires in its task)."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def __call__(self, event: Event) -> None:
        if not self.tracing.enabled:
            return
        if isinstance(event, RequestRouted):
            scores = getattr(event, "scores", ())
            self.tracing.annotate(
                decision_attributes(
                    event.replica_id,
                    event.reason.value,
                    scores,
                    key_source=event.key_source.value,
                    attempt=event.attempt,
                    disagreement=event.disagreement,
                    route=event.route,
                )
            )
        elif isinstance(event, AffinityBroken):
            self.tracing.annotate({"kvroute.affinity_break": event.reason.value})
        elif isinstance(event, ResidencyJudged):
            judged: dict[str, object] = {"kvroute.residency": event.residency, "kvroute.found_resident": event.found}
            if event.resident_tokens is not None:
                judged["kvroute.resident_tokens"] = event.resident_tokens
            self.tracing.annotate(judged)
        elif isinstance(event, UpstreamRetry):
            self.tracing.annotate({"kvroute.retries": event.attempt, "kvroute.last_retry_error": event.error})
        elif isinstance(event, RequestFinished):
            attrs: dict[str, object] = {"kvroute.retries": event.retries, "kvroute.stream": event.stream}
            if event.prompt_tokens is not None:
                attrs["kvroute.prompt_tokens"] = event.prompt_tokens
            if event.cached_tokens is not None:
                attrs["kvroute.cached_tokens"] = event.cached_tokens
            self.tracing.annotate(attrs)


@dataclass(slots=True)
class FleetSampler:
    """Samples the fleet at a fixed interval: stats time series and the autoscale EWMA."""

    store: StateStore
    clock: Clock
    stats: RollingStats
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    interval_s: float = 1.0
    state: AutoscaleState = field(default_factory=AutoscaleState)
    last_replicas: tuple[ReplicaState, ...] = ()

    async def sample_once(self) -> None:
        reps = await self.store.replicas()
        now = self.clock.now()
        self.last_replicas = reps
        active = [r for r in reps if r.status is ReplicaStatus.ACTIVE]
        self.stats.sample(now, [r.in_flight for r in active])
        self.state = observe(
            self.state,
            AutoscaleSample(
                now=now,
                in_flight=sum(r.in_flight for r in reps),
                active_context_tokens=sum(r.active_context_tokens for r in reps),
            ),
            self.autoscale,
        )

    def desired(self, _replicas: object = None) -> int | None:
        return None if self.state.updated_at is None else desired_replicas(self.state, self.autoscale)

    async def run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except (KvrouteError, OSError, TimeoutError) as exc:  # a store hiccup must not kill the sampler
                log.warning("fleet sample failed: %s", exc)
            await asyncio.sleep(self.interval_s)


class OperatorSurface:
    """Metrics, stats, sampler, tracing and the admin app for one gateway app.

    ``setup(app)`` is an ``extra_setup`` function for ``make_app``. On a gateway app it binds to the
    runtime (``RUNTIME_KEY``): store, clock, and the policy, which it wraps in a :class:`PolicyHolder`
    so ``PATCH /admin/config`` swaps what the gateway routes with; it registers its hooks on the
    gateway's emitter, its response counter and tracing on the gateway middleware and runtime. On a
    bare app (tests) give ``store``/``clock``/``holder`` explicitly; only the routes are mounted.
    """

    def __init__(
        self,
        *,
        admin: AdminSettings,
        tracing: Tracing = NOOP_TRACING,
        store: StateStore | None = None,
        clock: Clock | None = None,
        holder: PolicyHolder | None = None,
        stats_window_s: float = 300.0,
        sample_interval_s: float = 1.0,
        autoscale: AutoscaleConfig | None = None,
        admin_listen: tuple[str, int] | None = None,
    ) -> None:
        self.admin = admin
        # (host, port): serve /admin from its own listener instead of the gateway's port
        self.admin_listen = admin_listen
        self.admin_url: str | None = None  # set once the separate admin listener is up
        self.tracing = tracing
        self.store = store
        self.clock = clock
        self.holder = holder
        self.stats = RollingStats(window_s=stats_window_s, bucket_s=max(0.1, min(1.0, sample_interval_s)))
        self.sample_interval_s = sample_interval_s
        self.autoscale = autoscale or AutoscaleConfig()
        self._sampler: FleetSampler | None = None
        self.metrics = GatewayMetrics(desired_replicas=self._desired)
        if store is not None and clock is not None:
            self._bind(store, clock)

    @property
    def sampler(self) -> FleetSampler:
        if self._sampler is None:
            raise RuntimeError("the operator surface is not bound to a store yet (call setup(app))")
        return self._sampler

    def _bind(self, store: StateStore, clock: Clock) -> None:
        self.store, self.clock = store, clock
        self._sampler = FleetSampler(
            store=store,
            clock=clock,
            stats=self.stats,
            autoscale=self.autoscale,
            interval_s=self.sample_interval_s,
        )

    def _desired(self, replicas: object = None) -> int | None:
        return None if self._sampler is None else self._sampler.desired()

    def hooks(self) -> tuple[Hook, ...]:
        hooks: list[Hook] = [self.metrics, StatsHook(self.stats)]
        if self.tracing.enabled:
            hooks.append(TracingHook(self.tracing))
        return tuple(hooks)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        assert self.store is not None and self.clock is not None
        reps = await self.store.replicas()
        body = self.metrics.render(reps, self.clock.now(), self.store)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    def setup(self, app: web.Application) -> None:
        """Mount everything on the (not yet frozen) app; see the class docstring."""
        from router.gateway.runtime import EMITTER_KEY, MIDDLEWARE_KEY, RUNTIME_KEY

        if RUNTIME_KEY in app:
            rt = app[RUNTIME_KEY]
            self._bind(rt.store, rt.clock)
            if isinstance(rt.policy, PolicyHolder):
                self.holder = rt.policy
            else:
                name = getattr(rt.policy, "name", rt.config.policy)
                params = getattr(rt.policy, "params", None)
                if not isinstance(params, PolicyParams):
                    params = rt.config.policy_params_obj()
                self.holder = PolicyHolder(name, params, initial=rt.policy)
                rt.policy = self.holder
            for hook in self.hooks():
                app[EMITTER_KEY].add(hook)
            gateway_mw = app[MIDDLEWARE_KEY]
            gateway_mw.add_observer(self.metrics.response_observer())
            for mw in self.tracing.middlewares():
                gateway_mw.add_outer(mw)
            rt.tracer = self.tracing.upstream_tracer()
            self.metrics.discovery.source = lambda: rt.discovery
            self.metrics.handoff.source = lambda: handoff.stats if (handoff := app.get(HANDOFF_KEY)) else None
            self.metrics.kv_events.source = lambda: rt.residency.stats() if rt.residency is not None else None
        if self.store is None or self.clock is None or self.holder is None:
            raise RuntimeError("OperatorSurface.setup on a bare app needs store, clock and holder")
        app.router.add_get("/metrics", self.metrics_handler)
        kv_events = None
        if RUNTIME_KEY in app:
            runtime = app[RUNTIME_KEY]

            def kv_events() -> dict[str, Any]:  # the service is made at start-up, after this
                svc = runtime.residency
                return {"mode": "off"} if svc is None else svc.stats()

        admin_app = make_admin_app(self.store, self.holder, self.stats, self.clock, self.admin, kv_events)
        if self.admin_listen is None:
            app.add_subapp("/admin", admin_app)
        else:
            app.cleanup_ctx.append(self._admin_listener(admin_app, *self.admin_listen))
        app.cleanup_ctx.append(self._background)

    def _admin_listener(
        self, admin_app: web.Application, host: str, port: int
    ) -> Callable[[web.Application], AsyncIterator[None]]:
        async def ctx(_app: web.Application) -> AsyncIterator[None]:
            root = web.Application()
            root.add_subapp("/admin", admin_app)
            runner = web.AppRunner(root, access_log=None, handle_signals=False)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port, reuse_address=True).start()
                bound = int(runner.addresses[0][1])
                shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
                self.admin_url = f"http://[{shown}]:{bound}" if ":" in shown else f"http://{shown}:{bound}"
                yield
            finally:
                await runner.cleanup()

        return ctx

    async def _background(self, _app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.sampler.run(), name="kvroute-fleet-sampler")]
        if self.store is not None and self.holder is not None:
            follow = follow_shared_config(self.store, self.holder, SHARED_CONFIG_POLL_S)
            tasks.append(asyncio.create_task(follow, name="kvroute-shared-config"))
        try:
            yield
        finally:
            await stop_tasks(*tasks)
            await self.tracing.close()


def make_operator_surface(
    *,
    store: StateStore,
    clock: Clock,
    holder: PolicyHolder,
    admin: AdminSettings,
    tracing: Tracing = NOOP_TRACING,
    stats_window_s: float = 300.0,
    sample_interval_s: float = 1.0,
    autoscale: AutoscaleConfig | None = None,
) -> OperatorSurface:
    """An operator surface for a bare app (explicit store, clock and policy holder)."""
    return OperatorSurface(
        admin=admin,
        tracing=tracing,
        store=store,
        clock=clock,
        holder=holder,
        stats_window_s=stats_window_s,
        sample_interval_s=sample_interval_s,
        autoscale=autoscale,
    )


def operator_surface_from_config(config: GatewayConfig, *, tracing_exporter: Any = None) -> OperatorSurface:
    """What ``kvroute serve`` mounts: admin settings and tracing from the gateway config."""
    token = config.admin_token.get_secret_value() if config.admin_token is not None else None
    networks = tuple(getattr(config, "admin_networks", ()) or DEFAULT_ALLOWED_NETWORKS)
    endpoint = getattr(config, "otel_endpoint", None)
    tracing = make_tracing(
        bool(getattr(config, "otel", False) or endpoint or tracing_exporter is not None),
        service_name=getattr(config, "otel_service_name", "kvroute-gateway"),
        exporter=tracing_exporter,
        otlp_endpoint=endpoint,
    )
    admin_port = getattr(config, "admin_port", None)
    return OperatorSurface(
        admin=AdminSettings(
            token=token or None,
            insecure=bool(getattr(config, "admin_insecure", False)),
            allowed_networks=networks,
        ),
        tracing=tracing,
        admin_listen=None if admin_port is None else (config.host, admin_port),
    )

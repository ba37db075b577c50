"""The operator surface wired together: metrics + rolling stats + autoscale signal + tracing + admin.

Usage (what ``kvroute serve`` does)::

    surface = make_operator_surface(store=store, clock=clock, holder=PolicyHolder(name, params),
                                    admin=AdminSettings(token=...), tracing=make_tracing(otel_on))
    app = make_app(config, store, surface.holder, clock=clock, rng=rng,
                   hooks=surface.hooks(), extra_setup=(surface.setup,))

``setup(app)`` mounts ``/admin`` (sub-app), ``GET /metrics`` and the tracing middleware, and runs the
fleet sampler (dispersion/CHR time series and the autoscale EWMA) as a ``cleanup_ctx`` task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from router.autoscale import AutoscaleConfig, AutoscaleSample, AutoscaleState, desired_replicas, observe
from router.clock import Clock
from router.events import AffinityBroken, Event, Hook, RequestFinished, RequestRouted, UpstreamRetry
from router.gateway.admin import AdminSettings, PolicyHolder, make_admin_app
from router.model import ReplicaState, ReplicaStatus
from router.observability.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from router.observability.stats import RollingStats
from router.observability.tracing import NOOP_TRACING, Tracing, decision_attributes
from router.store.base import StateStore

__all__ = ["FleetSampler", "OperatorSurface", "StatsHook", "TracingHook", "make_operator_surface"]


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
            with contextlib.suppress(Exception):  # a store hiccup must not kill the sampler
                await self.sample_once()
            await asyncio.sleep(self.interval_s)


@dataclass(slots=True)
class OperatorSurface:
    store: StateStore
    clock: Clock
    holder: PolicyHolder
    admin: AdminSettings
    metrics: GatewayMetrics
    stats: RollingStats
    sampler: FleetSampler
    tracing: Tracing = NOOP_TRACING

    def hooks(self) -> tuple[Hook, ...]:
        hooks: list[Hook] = [self.metrics, StatsHook(self.stats)]
        if self.tracing.enabled:
            hooks.append(TracingHook(self.tracing))
        return tuple(hooks)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        reps = await self.store.replicas()
        body = self.metrics.render(reps, self.clock.now(), self.store)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def setup(self, app: web.Application) -> None:
        """Mount everything on the (not yet frozen) gateway app."""
        for mw in self.tracing.middlewares():
            app.middlewares.insert(0, mw)
        app.router.add_get("/metrics", self.metrics_handler)
        app.add_subapp("/admin", make_admin_app(self.store, self.holder, self.stats, self.clock, self.admin))
        app.cleanup_ctx.append(self._background)

    async def _background(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.sampler.run(), name="kvroute-fleet-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
    stats = RollingStats(window_s=stats_window_s, bucket_s=max(0.1, min(1.0, sample_interval_s)))
    sampler = FleetSampler(
        store=store,
        clock=clock,
        stats=stats,
        autoscale=autoscale or AutoscaleConfig(),
        interval_s=sample_interval_s,
    )
    metrics = GatewayMetrics(desired_replicas=sampler.desired)
    return OperatorSurface(
        store=store,
        clock=clock,
        holder=holder,
        admin=admin,
        metrics=metrics,
        stats=stats,
        sampler=sampler,
        tracing=tracing,
    )

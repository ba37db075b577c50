"""Wiring: ``make_app`` builds the gateway's ``web.Application`` from injected parts.

Rules:
  1. Nothing here reads the environment, the wall clock or global randomness: config, store,
     policy, clock and rng are passed in. ``serve.py`` is the only process entry.
  2. Lifecycles are ``cleanup_ctx`` pairs: the upstream client (one pool), static replica
     registration, and the discovery loops (cancelled on exit).
  3. One middleware (``GatewayMiddleware``). Extension point for the admin, metrics and tracing
     parts: ``extra_setup`` callables receive the app before it starts and add routes, a
     ``/admin`` sub-app, hooks (``app[EMITTER_KEY].add``), response observers and an outer
     middleware (``app[MIDDLEWARE_KEY]``), an upstream tracer (``app[RUNTIME_KEY].tracer``).
     Typed keys are exported here.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from aiohttp import web

from router.clock import Clock
from router.config import GatewayConfig
from router.discovery import Discovery
from router.eventloop import stop_tasks
from router.events import Emitter, Hook
from router.gateway.admin import DEFAULT_ALLOWED_NETWORKS
from router.gateway.egress import EgressGuard
from router.gateway.engine_sessions import SESSION_ROUTES
from router.gateway.forward import ReplicaClient
from router.gateway.handlers import (
    COUNT_TOKENS_ROUTE,
    INFERENCE_ROUTES,
    handle_health,
    handle_inference,
    handle_model,
    handle_models,
    handle_ready,
)
from router.gateway.middleware import GatewayMiddleware
from router.gateway.runtime import (
    CONFIG_KEY,
    EMITTER_KEY,
    MIDDLEWARE_KEY,
    RUNTIME_KEY,
    STORE_KEY,
    GatewayRuntime,
)
from router.gateway.stored_responses import STORED_RESPONSE_ROUTES, handle_stored_response
from router.gateway.upstream import ReplicaHttpClient
from router.policy.base import Policy
from router.store.base import StateStore

__all__ = [
    "CONFIG_KEY",
    "EMITTER_KEY",
    "MIDDLEWARE_KEY",
    "RUNTIME_KEY",
    "STORE_KEY",
    "GatewayRuntime",
    "make_app",
]

SetupFn = Callable[[web.Application], None]


def make_app(
    config: GatewayConfig,
    store: StateStore,
    policy: Policy,
    *,
    clock: Clock,
    rng: random.Random,
    client: ReplicaClient | None = None,
    hooks: Iterable[Hook] = (),
    extra_setup: Sequence[SetupFn] = (),
    discovery: bool = True,
    register_static: bool = True,
) -> web.Application:
    """The gateway application.

    ``client``: an upstream client to use (tests); by default a ``ReplicaHttpClient`` is created at
    start-up and closed at cleanup. ``discovery=False`` runs no polling loops (replica states are
    then whatever the store says).
    """
    emitter = Emitter(hooks)
    rt = GatewayRuntime(
        config=config, store=store, policy=policy, clock=clock, rng=rng, emit=emitter, client=client
    )
    rt.egress = EgressGuard(config.replicas, config.admin_networks or DEFAULT_ALLOWED_NETWORKS, clock)
    gateway_mw = GatewayMiddleware()
    app = web.Application(
        middlewares=[gateway_mw],
        client_max_size=config.limits.max_body_bytes,
        handler_args={
            "max_line_size": config.limits.max_line_size,
            "max_field_size": config.limits.max_field_size,
            "max_headers": config.limits.max_headers,
        },
    )
    app[CONFIG_KEY] = config
    app[STORE_KEY] = store
    app[EMITTER_KEY] = emitter
    app[RUNTIME_KEY] = rt
    app[MIDDLEWARE_KEY] = gateway_mw

    async def close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
        # a shutting-down gateway ends each keep-alive connection with its current answer, so clients
        # reconnect (to the next gateway on the port) instead of keeping a connection it must cut
        if rt.draining:
            response.force_close()
            response.headers["Connection"] = "close"  # aiohttp wrote its own before this hook ran

    app.on_response_prepare.append(close_when_draining)

    for path in (*INFERENCE_ROUTES, COUNT_TOKENS_ROUTE):
        app.router.add_post(path, handle_inference)
    for path in SESSION_ROUTES:  # SGLang takes both (router/gateway/engine_sessions.py)
        app.router.add_post(path, handle_inference)
        app.router.add_route("GET", path, handle_inference)
    app.router.add_get(STORED_RESPONSE_ROUTES[0], handle_stored_response)
    app.router.add_post(STORED_RESPONSE_ROUTES[1], handle_stored_response)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model}", handle_model)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        own = rt.client is None
        if own:
            rt.client = ReplicaHttpClient(
                config.timeouts,
                max_connections=config.max_connections,
                max_connections_per_replica=config.max_connections_per_replica,
            )
        yield
        if own and rt.client is not None:
            await rt.client.close()

    async def registry_ctx(app: web.Application) -> AsyncIterator[None]:
        start = getattr(store, "start", None)  # the Redis store publishes its gateway lease
        if start is not None:
            await start()
        if register_static:
            for spec in config.replica_specs():
                await store.upsert_replica(spec)  # new ones start JOINING; existing keep their state
        yield

    async def discovery_ctx(app: web.Application) -> AsyncIterator[None]:
        assert rt.client is not None
        d = Discovery(
            store,
            rt.client,
            config.health,
            clock=clock,
            emit=emitter,
            rng=random.Random(rng.random()),
            probe_timeout_s=config.timeouts.probe_s,
            egress=rt.egress,
            writer_id=getattr(store, "lease_holder", None) or config.gateway_id,  # rule 8: as in the lease list
        )
        rt.discovery = d
        tasks: list[asyncio.Task[None]] = []
        if discovery:
            await d.check_health_once()  # first round before serving: static replicas become ACTIVE
            await d.scrape_once()
            tasks = [
                asyncio.create_task(d.run_health(), name="kvroute-health"),
                asyncio.create_task(d.run_scrape(), name="kvroute-scrape"),
            ]
        yield
        await stop_tasks(*tasks)

    async def residency_ctx(app: web.Application) -> AsyncIterator[None]:
        # exact residency from the replicas' KV events (router/gateway/residency.py)
        assert rt.client is not None
        from router.gateway.residency import make_residency

        rt.residency = make_residency(config, store, rt.client, egress=rt.egress)
        # serve the first requests on what the engines hold: after a restart on embedded state each
        # session's next turn then goes back to its cache (placed_resident), not where load says
        if rt.residency is not None:
            await rt.residency.ready(config.kv_events.replay_timeout_s + config.timeouts.probe_s)
        yield
        if rt.residency is not None:
            svc, rt.residency = rt.residency, None
            await svc.close()

    async def background_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await rt.background.close()  # before the client closes: each held lease is released

    app.cleanup_ctx.extend([client_ctx, registry_ctx, discovery_ctx, residency_ctx, background_ctx])
    for fn in extra_setup:
        fn(app)
    return app

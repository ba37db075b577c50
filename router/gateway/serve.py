"""``kvroute serve``: run the gateway; ``start_gateway``: the same in-process (demo, tests).

Rules:
  1. This is the only module of the gateway that reads ``os.environ``, argv and signals.
  2. Handlers are cancelled when their client disconnects (``handler_cancellation=True``): that is
     what lets a client's disconnect abort the upstream request at once.
  3. SIGTERM / SIGINT: ``/ready`` turns 503, the listening socket closes, in-flight requests get
     ``timeouts.shutdown_s`` to finish, then the rest is cancelled (their load is released).
  4. Once listening, the start-up heap is frozen out of the cyclic GC (``gc.freeze``): a full
     collection then walks only what serving allocated, not ~56k start-up objects (19 ms to walk).
  5. The listener is the raw data plane (``downstream.server: raw``, router/gateway/dataplane.py):
     inference routes on httptools, everything else handed to aiohttp on the same connection. When
     the app has middlewares of its own (tracing), or with ``downstream.server: aiohttp``, aiohttp's
     server takes every request.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import signal
import ssl
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.clock import Clock, SystemClock
from router.config import GatewayConfig, load_config
from router.errors import ConfigError
from router.eventloop import event_loop_factory
from router.events import Hook
from router.gateway.app import SetupFn, make_app
from router.gateway.dataplane import DataPlane, DataPlaneSite
from router.gateway.forward import ReplicaClient
from router.gateway.keys import MIDDLEWARE_KEY, RUNTIME_KEY, GatewayRuntime
from router.policy import Policy
from router.store.base import StateStore

__all__ = [
    "RunningGateway",
    "cli_main",
    "event_loop_factory",
    "listener_ssl_context",
    "make_store",
    "start_gateway",
]

log = logging.getLogger("kvroute.gateway")


def make_store(config: GatewayConfig, clock: Clock) -> StateStore:
    """The embedded memory store, or Redis when ``redis_url`` is set (``router.store.factory``)."""
    from router.store.factory import make_store as factory

    try:
        return factory(config, clock)
    except ImportError as exc:
        raise ConfigError(f"redis_url: the Redis store cannot be loaded: {exc}") from exc


def make_policy_from_config(config: GatewayConfig) -> Policy:
    from router.policy.registry import make_policy

    try:
        return make_policy(config.policy, config.policy_params_obj())
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


@dataclass(slots=True)
class RunningGateway:
    url: str  # http://host:port
    port: int
    app: web.Application
    runner: web.AppRunner
    store: StateStore
    owns_store: bool = False  # created by start_gateway: closed with it

    @property
    def runtime(self) -> GatewayRuntime:
        return self.app[RUNTIME_KEY]

    async def close(self) -> None:
        await shutdown(self.runner, self.app)
        if self.owns_store:
            await self.store.close()


async def start_gateway(
    config: GatewayConfig,
    store: StateStore | None = None,
    *,
    policy: Policy | None = None,
    clock: Clock | None = None,
    rng: random.Random | None = None,
    client: ReplicaClient | None = None,
    hooks: Iterable[Hook] = (),
    extra_setup: Sequence[SetupFn] = (),
    discovery: bool = True,
    access_log: bool | None = None,
    middlewares: Sequence[object] = (),
    trace_configs: Sequence[object] = (),
) -> RunningGateway:
    """Start the gateway on ``config.host:config.port`` (port 0 = a free port) in this loop.

    HTTPS when ``config.tls_cert``/``tls_key`` are set (then ``url`` is ``https://...``)."""
    ssl_context = listener_ssl_context(config)  # before anything starts: a bad key fails fast
    clock = clock or SystemClock()
    owns_store = store is None
    store = store if store is not None else make_store(config, clock)
    policy = policy or make_policy_from_config(config)
    rng = rng or random.Random(config.seed)
    app = make_app(
        config,
        store,
        policy,
        clock=clock,
        rng=rng,
        client=client,
        hooks=hooks,
        extra_setup=extra_setup,
        discovery=discovery,
        middlewares=middlewares,
        trace_configs=trace_configs,
    )
    want_access_log = config.access_log if access_log is None else access_log
    access_logger = logging.getLogger("kvroute.access") if want_access_log else None
    runner = _JsonErrorsAppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.timeouts.shutdown_s,
        access_log=access_logger,
        keepalive_timeout=config.downstream.keepalive_s,
    )
    await runner.setup()
    gateway_mw = app[MIDDLEWARE_KEY]
    site: web.BaseSite
    plane: DataPlane | None = None
    # rule 5: the raw data plane unless aiohttp must see every request (tracing's server spans)
    if config.downstream.server == "raw" and all(m is gateway_mw for m in app.middlewares):
        assert runner.server is not None
        plane = DataPlane(
            app[RUNTIME_KEY],
            gateway_mw,
            runner.server,
            access_log=access_logger,
        )
        site = DataPlaneSite(runner, plane, config.host, config.port, ssl_context=ssl_context)
    else:
        site = web.TCPSite(runner, config.host, config.port, reuse_address=True, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError:
        if plane is not None:
            await plane.close()
        await runner.cleanup()
        raise
    app[RUNTIME_KEY].data_plane = plane
    port = int(runner.addresses[0][1])
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    scheme = "https" if ssl_context is not None else "http"
    url = f"{scheme}://{host}:{port}" if ":" not in host else f"{scheme}://[{host}]:{port}"
    return RunningGateway(url=url, port=port, app=app, runner=runner, store=store, owns_store=owns_store)


class _JsonErrorsRequestHandler(RequestHandler):
    """aiohttp answers requests its HTTP parser rejects (a bad request line, a header over the size
    limit, bytes that are not HTTP) itself, before any middleware runs, with a plain-text body. Clients
    of an OpenAI-compatible API expect JSON errors everywhere: same status, OpenAI-style body."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; refuses if bytes were sent
        status = plain.status
        reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        text = message if status < 500 and message else reason
        body = {
            "error": {
                "message": text,
                "type": "invalid_request_error" if status < 500 else "internal_error",
                "code": "bad_http_request" if status < 500 else "internal_error",
            }
        }
        resp = web.json_response(body, status=status)
        resp.force_close()
        return resp


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorsRequestHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorsAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer HTTP parse errors with JSON (see above)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorsServer  # same state, one overridden factory method
        return server


def listener_ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """TLS of the listener (``tls_cert`` + ``tls_key``), TLS 1.2 or newer; ``None`` = plain HTTP."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot load the certificate and key: {exc}") from exc
    return ctx


async def shutdown(runner: web.AppRunner, app: web.Application) -> None:
    """Graceful: refuse new work, let in-flight requests finish (bounded), then clean up."""
    rt = app[RUNTIME_KEY]
    rt.draining = True
    deadline = rt.clock.now() + rt.config.timeouts.shutdown_s
    for site in list(runner.sites):
        await site.stop()  # stop accepting; established keep-alive connections may still finish
    while rt.in_flight > 0 and rt.clock.now() < deadline:
        await asyncio.sleep(0.05)
    if rt.data_plane is not None:
        await rt.data_plane.close()  # what is still running is cancelled (its load released)
    await runner.cleanup()


async def _serve(config: GatewayConfig) -> int:
    from router.observability.surface import operator_surface_from_config

    # operator surface: /admin (token or --admin-insecure), /metrics, tracing (docs/OPERATIONS.md)
    surface = operator_surface_from_config(config)
    setups: list[SetupFn] = [surface.setup]
    if config.warm_handoff:
        from router.handoff import handoff_setup

        setups.append(handoff_setup())
    gw = await start_gateway(config, extra_setup=setups, trace_configs=surface.tracing.trace_configs())
    # rule 4: what start-up allocated (modules, config, app) lives as long as the process
    gc.collect()
    gc.freeze()
    if surface.admin_url is not None:
        print(f"kvroute admin API listening on {surface.admin_url}/admin", file=sys.stderr, flush=True)
    if not surface.admin.enabled:
        log.info("admin API disabled: no admin token (--admin-token / KVROUTE_ADMIN_TOKEN)")
    elif surface.admin.insecure and not surface.admin.token:
        log.warning("admin API served WITHOUT authentication (--admin-insecure): local demos only")
    log.info(
        "kvroute gateway %s listening on %s (policy %s, %d static replicas)",
        config.gateway_id,
        gw.url,
        config.policy,
        len(config.replicas),
    )
    print(f"kvroute gateway listening on {gw.url}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down (in flight: %d)", gw.runtime.in_flight)
    finally:
        await gw.close()
    return 0


def cli_main(argv: list[str]) -> int:
    """``kvroute serve [--host H] --port P --replica URL ... [--policy kv_aware] [--config F]``."""
    try:
        config = load_config(argv, os.environ)
        make_policy_from_config(config)  # fail fast on a bad policy name
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    from router.observability.logging import configure_logging

    configure_logging(config.log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(os.environ)) as runner:
            return runner.run(_serve(config))
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvroute serve: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1

"""``kvroute serve``: run the gateway; ``start_gateway``: the same in-process (demo, tests).

Rules:
  1. This is the only module of the gateway that reads ``os.environ``, argv and signals.
  2. Handlers are cancelled when their client disconnects (``handler_cancellation=True``): that is
     what lets a client's disconnect abort the upstream request at once.
  3. SIGTERM / SIGINT: ``/ready`` turns 503, the listening socket closes, in-flight requests get
     ``timeouts.shutdown_s`` to finish, then the rest is cancelled (their load is released).
  4. Once listening, the start-up heap is frozen out of the cyclic GC (``gc.freeze``): a full
     collection then walks only what serving allocated, not the start-up objects.
  5. One server: aiohttp's, for every route, through public API only. The listener is an asyncio
     server whose connections are ``web.RequestHandler`` s of the runner's ``web.Server``, of a
     subclass that answers what aiohttp's HTTP parser refuses (a bad request line, a header over the
     size limit, bytes that are not HTTP) with the gateway's JSON error instead of plain text.
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
from typing import Any

from aiohttp import web

from router.clock import Clock, SystemClock
from router.config import GatewayConfig, load_config
from router.errors import ConfigError
from router.eventloop import event_loop_factory
from router.events import Hook
from router.gateway.app import SetupFn, make_app
from router.gateway.forward import ReplicaClient
from router.gateway.middleware import parse_error_body
from router.gateway.runtime import RUNTIME_KEY, GatewayRuntime
from router.policy.base import Policy
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
    listener: asyncio.Server
    store: StateStore
    owns_store: bool = False  # created by start_gateway: closed with it

    @property
    def runtime(self) -> GatewayRuntime:
        return self.app[RUNTIME_KEY]

    async def close(self) -> None:
        await shutdown(self.runner, self.listener, self.app)
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
    )
    want_access_log = config.access_log if access_log is None else access_log
    access_logger = logging.getLogger("kvroute.access") if want_access_log else None
    handler_kwargs: dict[str, Any] = {
        "access_log": access_logger,
        "keepalive_timeout": config.downstream.keepalive_s,
        "max_line_size": config.limits.max_line_size,
        "max_field_size": config.limits.max_field_size,
        "max_headers": config.limits.max_headers,
        "auto_decompress": False,  # request bodies are forwarded as they came
    }
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=config.timeouts.shutdown_s, **handler_kwargs
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()

    def connection() -> _JsonErrorsRequestHandler:
        return _JsonErrorsRequestHandler(server, loop=loop, **handler_kwargs)

    try:
        listener = await loop.create_server(
            connection, config.host, config.port, ssl=ssl_context, reuse_address=True, backlog=128,
            reuse_port=config.reuse_port or None,
        )
    except OSError:
        await runner.cleanup()
        raise
    port = int(listener.sockets[0].getsockname()[1])
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    scheme = "https" if ssl_context is not None else "http"
    url = f"{scheme}://{host}:{port}" if ":" not in host else f"{scheme}://[{host}]:{port}"
    return RunningGateway(
        url=url, port=port, app=app, runner=runner, listener=listener, store=store, owns_store=owns_store
    )


class _JsonErrorsRequestHandler(web.RequestHandler):
    """aiohttp answers requests its HTTP parser rejects (a bad request line, a header over the size
    limit, bytes that are not HTTP) itself, before any middleware runs, with a plain-text body. Clients
    of an OpenAI-compatible API expect JSON errors everywhere: same status, OpenAI-style body."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; refuses if bytes were sent
        body, code = parse_error_body(plain.status, message)
        resp = web.json_response(body, status=plain.status, headers={"X-Kvroute-Error": code})
        resp.force_close()
        return resp


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


async def shutdown(runner: web.AppRunner, listener: asyncio.Server, app: web.Application) -> None:
    """Graceful: refuse new work, let in-flight requests finish (bounded), then clean up (what is
    still running is cancelled; its load is released)."""
    rt = app[RUNTIME_KEY]
    rt.draining = True
    deadline = rt.clock.now() + rt.config.timeouts.shutdown_s
    listener.close()  # stop accepting; established keep-alive connections may still finish
    while rt.in_flight > 0 and rt.clock.now() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()


async def _serve(config: GatewayConfig) -> int:
    from router.observability.surface import operator_surface_from_config

    # operator surface: /admin (token or --admin-insecure), /metrics, tracing (docs/OPERATIONS.md)
    surface = operator_surface_from_config(config)
    setups: list[SetupFn] = [surface.setup]
    if config.warm_handoff:
        from router.handoff import handoff_setup

        setups.append(handoff_setup())
    gw = await start_gateway(config, extra_setup=setups)
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

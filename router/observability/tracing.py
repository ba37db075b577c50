"""OpenTelemetry tracing for the gateway: off by default, near-zero cost when off.

Rules:
  1. ``opentelemetry`` is imported lazily, only by :func:`make_tracing` with ``enabled=True``. With
     tracing off the gateway gets :data:`NOOP_TRACING`: no middleware, no upstream tracer, and the
     event hook returns at once. Tracing on or off, the gateway runs the same HTTP stack.
  2. Each proxied request gets one SERVER span (``kvroute.request``), parented on an incoming W3C
     ``traceparent`` if the client sent one. The routing decision is written onto it as attributes
     (``kvroute.replica``, ``kvroute.reason``, ``kvroute.score``, ``kvroute.scores``...) when the gateway
     emits its routed event inside the request's task.
  3. The upstream call gets a CLIENT child span (``kvroute.upstream``) from the upstream tracer
     (``router.gateway.forward.UpstreamTracer``, called by the handler around ``ReplicaClient.send``,
     whichever client that is); its context is added to the upstream request headers as W3C
     ``traceparent`` (and ``tracestate``), so the replica continues the trace.
  4. The tracer provider is owned by the :class:`OtelTracing` object, never installed globally, so
     several gateways (and tests) in one process do not share spans.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import web

__all__ = [
    "NOOP_TRACING",
    "NoopTracing",
    "OtelTracing",
    "Tracing",
    "decision_attributes",
    "make_tracing",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths that never get a span (operator surface and probes): tracing is for the inference routes.
_UNTRACED_PREFIXES = ("/admin", "/metrics", "/health", "/ready")


class Tracing(Protocol):
    enabled: bool

    def middlewares(self) -> Sequence[Any]:
        """aiohttp middlewares to add to the gateway app (empty when off)."""
        ...

    def upstream_tracer(self) -> Any:
        """A ``router.gateway.forward.UpstreamTracer`` for the gateway's runtime (``None`` when off)."""
        ...

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        """Add attributes to the current request span (no-op outside a request or when off)."""
        ...

    async def close(self) -> None: ...


class NoopTracing:
    """Tracing switched off: every method is a constant-time no-op."""

    enabled = False

    def middlewares(self) -> Sequence[Any]:
        return ()

    def upstream_tracer(self) -> None:
        return None

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        return None

    async def close(self) -> None:
        return None


NOOP_TRACING = NoopTracing()


def decision_attributes(
    replica_id: str,
    reason: str,
    scores: Iterable[tuple[str, float]] = (),
    **extra: Any,
) -> dict[str, Any]:
    """Span attributes for a routing decision (OTel attribute values: str/bool/int/float or lists)."""
    score_list = list(scores)
    attrs: dict[str, Any] = {"kvroute.replica": replica_id, "kvroute.reason": str(reason)}
    if score_list:
        attrs["kvroute.scores"] = [f"{rid}={s:.6g}" for rid, s in score_list]
        attrs["kvroute.candidates"] = len(score_list)
        for rid, s in score_list:
            if rid == replica_id:
                attrs["kvroute.score"] = float(s)
    for key, val in extra.items():
        if val is None:
            continue
        if isinstance(val, str | bool | int | float):
            attrs[f"kvroute.{key}"] = val
        else:
            attrs[f"kvroute.{key}"] = str(val)
    return attrs


class OtelTracing:
    """Tracing on: see the module rules. Build it with :func:`make_tracing`."""

    enabled = True

    def __init__(self, provider: Any, service_name: str) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._ctx = otel_context
        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("kvroute.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self.service_name = service_name
        self._middleware = self._make_middleware()
        self._upstream = _UpstreamTracer(trace, self._tracer, self._propagator)

    @property
    def provider(self) -> Any:
        return self._provider

    def middlewares(self) -> Sequence[Any]:
        return (self._middleware,)

    def upstream_tracer(self) -> _UpstreamTracer:
        return self._upstream

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        span = self._trace.get_current_span()
        if span.is_recording():
            span.set_attributes(dict(attributes))

    async def close(self) -> None:
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- server side -------------------------------------------------------------------------

    def _make_middleware(self) -> Any:
        trace = self._trace
        tracer = self._tracer
        propagator = self._propagator
        ctx_mod = self._ctx

        @web.middleware
        async def otel_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith(_UNTRACED_PREFIXES):
                return await handler(request)
            parent = propagator.extract(carrier=dict(request.headers))
            span = tracer.start_span(
                "kvroute.request",
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={
                    "http.request.method": request.method,
                    "url.path": request.path,
                    "server.address": request.host,
                },
            )
            token = ctx_mod.attach(trace.set_span_in_context(span, parent))
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                span.set_attribute("http.response.status_code", exc.status)
                raise
            except BaseException as exc:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
                raise
            else:
                span.set_attribute("http.response.status_code", resp.status)
                if resp.status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
                rid = resp.headers.get("X-Request-Id")
                if rid:
                    span.set_attribute("kvroute.request_id", rid)
                return resp
            finally:
                ctx_mod.detach(token)
                span.end()

        return otel_middleware


class _UpstreamSpan:
    """One ``kvroute.upstream`` CLIENT span (module rule 3)."""

    __slots__ = ("_span", "_trace", "headers")

    def __init__(self, trace: Any, span: Any, headers: list[tuple[str, str]]) -> None:
        self._trace = trace
        self._span = span
        self.headers = headers

    def end(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        # the span covers connect + headers; the body (stream) is relayed under the parent span
        self._span.end()

    def fail(self, exc: BaseException) -> None:
        self._span.record_exception(exc)
        self._span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, type(exc).__name__))
        self._span.end()


class _UpstreamTracer:
    """``router.gateway.forward.UpstreamTracer`` over OpenTelemetry."""

    def __init__(self, trace: Any, tracer: Any, propagator: Any) -> None:
        self._trace = trace
        self._tracer = tracer
        self._propagator = propagator

    def start(self, method: str, url: str) -> _UpstreamSpan | None:
        trace = self._trace
        if not trace.get_current_span().get_span_context().is_valid:
            return None  # not inside a traced request (health polls, scrapes): stay quiet
        parts = urlsplit(url)
        span = self._tracer.start_span(
            "kvroute.upstream",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "http.request.method": method,
                "url.full": url.split("?", 1)[0],
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
            },
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return _UpstreamSpan(trace, span, list(carrier.items()))


def make_tracing(
    enabled: bool = False,
    *,
    service_name: str = "kvroute-gateway",
    exporter: Any = None,
    otlp_endpoint: str | None = None,
    batch: bool = True,
) -> Tracing:
    """Build the gateway's tracing.

    ``enabled=False`` (the default) returns :data:`NOOP_TRACING` without importing OpenTelemetry.
    Otherwise spans go to ``exporter`` (tests pass an ``InMemorySpanExporter``; a simple processor is
    used so spans are visible at once) or, with ``otlp_endpoint`` (e.g. ``http://collector:4318``), to
    an OTLP/HTTP exporter from the ``otel`` extra (batched).
    """
    if not enabled:
        return NOOP_TRACING
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("tracing needs the 'otel' extra: pip install 'kvroute[otel]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "the OTLP exporter needs the 'otel' extra: pip install 'kvroute[otel]'"
            ) from exc
        otlp = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(otlp) if batch else SimpleSpanProcessor(otlp))
    return OtelTracing(provider, service_name)

"""Tracing: server span + decision attributes + upstream child span + W3C traceparent propagation.

These run the tracing middleware and the upstream tracer on real sockets (aiohttp on 127.0.0.1:0, the
gateway's own ``ReplicaHttpClient`` towards the upstream) with an in-memory span exporter; the
gateway-level test lives in test_tracing_functional.py.
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from router.config import TimeoutsConfig
from router.errors import UpstreamError
from router.gateway.upstream import ReplicaHttpClient
from router.observability.tracing import NOOP_TRACING, decision_attributes, make_tracing


async def _upstream(seen: list[dict[str, str]]) -> TestServer:
    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server


async def _front(tracing: Any, upstream_url: str) -> tuple[TestServer, ReplicaHttpClient]:
    """A minimal proxy shaped like the gateway: middleware span, annotate decision, upstream call
    with a client span around it (as ``handlers._Proxy._attempt`` does)."""
    session = ReplicaHttpClient(TimeoutsConfig(connect_s=1.0, first_byte_s=2.0))
    tracer = tracing.upstream_tracer()

    async def handler(request: web.Request) -> web.Response:
        tracing.annotate(
            decision_attributes("r1", "affinity", [("r0", 0.5), ("r1", 0.25)], session_key_source="header")
        )
        url = upstream_url + "/v1/chat/completions"
        span = tracer.start("POST", url)
        try:
            resp = await session.send("r1", "POST", url, [("Content-Type", "application/json"), *span.headers], b"{}")
        except UpstreamError as exc:
            span.fail(exc)
            raise
        span.end(resp.status)
        body = await resp.read(1 << 20)
        return web.Response(body=body, status=resp.status, headers={"X-Request-Id": "rid-1"})

    async def health(_r: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=list(tracing.middlewares()))
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server, session


async def test_span_tree_decision_attributes_and_traceparent() -> None:
    exporter = InMemorySpanExporter()
    tracing = make_tracing(True, exporter=exporter)
    seen: list[dict[str, str]] = []
    up = await _upstream(seen)
    front, session = await _front(tracing, str(up.make_url("")).rstrip("/"))
    try:
        async with aiohttp.ClientSession() as client:
            incoming_trace = "0af7651916cd43dd8448eb211c80319c"
            hdr = {"traceparent": f"00-{incoming_trace}-b7ad6b7169203331-01"}
            async with client.post(front.make_url("/v1/chat/completions"), json={}, headers=hdr) as r:
                assert r.status == 200
            async with client.get(front.make_url("/health")) as r:
                assert r.status == 200
    finally:
        await session.close()
        await front.close()
        await up.close()
        await tracing.close()
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"kvroute.request", "kvroute.upstream"}  # /health is not traced
    server, client_span = by_name["kvroute.request"], by_name["kvroute.upstream"]
    assert server.kind is SpanKind.SERVER and client_span.kind is SpanKind.CLIENT
    # the incoming traceparent is continued
    assert format(server.context.trace_id, "032x") == incoming_trace
    assert client_span.parent is not None and client_span.parent.span_id == server.context.span_id
    attrs = dict(server.attributes or {})
    assert attrs["kvroute.replica"] == "r1" and attrs["kvroute.reason"] == "affinity"
    assert attrs["kvroute.score"] == 0.25 and attrs["kvroute.candidates"] == 2
    assert list(attrs["kvroute.scores"]) == ["r0=0.5", "r1=0.25"]
    assert attrs["kvroute.session_key_source"] == "header"
    assert attrs["http.response.status_code"] == 200 and attrs["kvroute.request_id"] == "rid-1"
    # the replica received the child span's context
    assert len(seen) == 1
    tp = seen[0]["traceparent"]
    _version, trace_id, span_id, flags = tp.split("-")
    assert trace_id == incoming_trace
    assert span_id == format(client_span.context.span_id, "016x")
    assert flags == "01"


async def test_upstream_failure_marks_client_span_error() -> None:
    exporter = InMemorySpanExporter()
    tracing = make_tracing(True, exporter=exporter)
    # a closed port: reserve one, then release it
    probe = await _upstream([])
    dead_url = str(probe.make_url("")).rstrip("/")
    await probe.close()
    front, session = await _front(tracing, dead_url)
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.post(front.make_url("/v1/chat/completions"), json={}) as r,
        ):
            assert r.status == 500
    finally:
        await session.close()
        await front.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert not spans["kvroute.upstream"].status.is_ok
    assert not spans["kvroute.request"].status.is_ok


def test_noop_is_free_and_does_not_import_otel() -> None:
    assert NOOP_TRACING.enabled is False
    assert NOOP_TRACING.middlewares() == () and NOOP_TRACING.upstream_tracer() is None
    assert make_tracing(False) is NOOP_TRACING
    NOOP_TRACING.annotate({"a": 1})


def test_tracing_module_imports_otel_lazily() -> None:
    import subprocess

    code = (
        "import sys, router.observability.tracing as t; t.make_tracing(False);"
        "print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"retry": 1}, {"kvroute.retry": 1}), ({"x": None}, {}), ({"obj": ("a",)}, {"kvroute.obj": "('a',)"})],
)
def test_decision_attributes_types(extra: dict[str, Any], expected: dict[str, Any]) -> None:
    attrs = decision_attributes("r", "hash", **extra)
    assert {k: v for k, v in attrs.items() if k not in {"kvroute.replica", "kvroute.reason"}} == expected


def test_otlp_exporter_posts_to_a_collector() -> None:
    """The OTLP/HTTP exporter (the 'otel' extra) ships spans to a collector: a tiny one on 127.0.0.1:0."""
    import asyncio
    import threading

    received: list[tuple[str, str, bytes]] = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> TestServer:
        async def traces(request: web.Request) -> web.Response:
            received.append((request.path, request.content_type, await request.read()))
            return web.Response(status=200, body=b"", content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        srv = TestServer(app, host="127.0.0.1", port=0)
        await srv.start_server()
        return srv

    srv = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        tracing = make_tracing(True, otlp_endpoint=str(srv.make_url("")).rstrip("/"), batch=False)
        provider = tracing.provider  # type: ignore[attr-defined]
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("kvroute.request") as span:
            span.set_attribute("kvroute.reason", "affinity")
        provider.shutdown()
    finally:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    assert len(received) == 1
    path, ctype, body = received[0]
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    assert b"kvroute.request" in body and b"affinity" in body and b"kvroute-gateway" in body

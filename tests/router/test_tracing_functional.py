"""A trace through the live gateway: span per request with the routing decision, a child span for the
upstream call, and the W3C traceparent arriving at the emulated replica (real sockets throughout)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from router.gateway.upstream import ReplicaHttpClient
from tests.router.test_metrics_functional import Stack, send, stack_factory

__all__ = ["stack_factory"]  # the fixture is shared with the metrics tests


async def test_trace_has_decision_and_reaches_the_replica(
    stack_factory: Callable[..., Awaitable[Stack]],
) -> None:
    exporter = InMemorySpanExporter()
    st = await stack_factory(3, tracing_exporter=exporter)
    gw = st.gateway
    # observing changes no code path: the same upstream client as with tracing off
    assert type(gw.runtime.client) is ReplicaHttpClient and gw.runtime.tracer is not None
    async with aiohttp.ClientSession() as s:
        code, hdrs = await send(s, gw.url, "traced-session", 0)
        assert code == 200
        code2, hdrs2 = await send(s, gw.url, "traced-session", 1, stream=True)
        assert code2 == 200
        async with s.get(gw.url + "/metrics") as r:  # operator endpoints are not traced
            assert r.status == 200
    spans = exporter.get_finished_spans()
    servers = [sp for sp in spans if sp.name == "kvroute.request"]
    clients = [sp for sp in spans if sp.name == "kvroute.upstream"]
    assert len(servers) == 2 and len(clients) == 2
    by_parent = {c.parent.span_id: c for c in clients if c.parent is not None}
    for server, h in zip(servers, (hdrs, hdrs2), strict=True):
        assert server.kind is SpanKind.SERVER
        attrs = dict(server.attributes or {})
        # the routing decision, as the client saw it in the response headers
        assert attrs["kvroute.replica"] == h["X-Kvroute-Replica"]
        assert attrs["kvroute.reason"] == h["X-Kvroute-Reason"]
        assert attrs["kvroute.key_source"] == "header" and attrs["kvroute.attempt"] == 0
        assert attrs["kvroute.request_id"] == h["X-Request-Id"]
        assert attrs["http.response.status_code"] == 200
        assert (
            attrs["kvroute.candidates"] >= 1 and len(attrs["kvroute.scores"]) == attrs["kvroute.candidates"]
        )
        assert isinstance(attrs["kvroute.score"], float)  # the chosen replica's score
        client = by_parent[server.context.span_id]
        assert client.kind is SpanKind.CLIENT and client.context.trace_id == server.context.trace_id
        # the child span's context is what the replica received
        rep = next(r for r in st.replicas if r.id == attrs["kvroute.replica"])
        want = f"00-{client.context.trace_id:032x}-{client.context.span_id:016x}-"
        got = [tp for hd in rep.headers if (tp := hd.get("traceparent", "")).startswith(want)]
        assert len(got) == 1
        assert int(got[0].rsplit("-", 1)[1], 16) & 0x01  # sampled
    assert dict(servers[0].attributes or {})["kvroute.reason"] == "placed_new"
    assert dict(servers[0].attributes or {})["kvroute.candidates"] == 3  # a placement scores every replica
    assert dict(servers[1].attributes or {})["kvroute.reason"] == "affinity"
    assert dict(servers[1].attributes or {})["kvroute.stream"] is True
    # health probes and scrapes of the replicas made no spans
    assert len(spans) == 4


async def test_tracing_off_sends_no_traceparent(stack_factory: Callable[..., Awaitable[Stack]]) -> None:
    st = await stack_factory(2)
    assert st.surface.tracing.enabled is False
    assert type(st.gateway.runtime.client) is ReplicaHttpClient and st.gateway.runtime.tracer is None
    async with aiohttp.ClientSession() as s:
        assert (await send(s, st.gateway.url, "plain", 0))[0] == 200
    assert all("traceparent" not in hd for r in st.replicas for hd in r.headers)

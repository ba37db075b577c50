"""Micro-benchmark of the observability hot path; prints JSON.

    python -m loadtests.bench_observability [--requests N] [--replicas R]

Measures, in this process and without the network: the cost per request of the metrics + stats
hooks (one RequestRouted + one RequestFinished event), of rendering ``/metrics`` for R replicas, of
one admin stats view, and of one traced request's spans (server + upstream) with tracing on versus
the no-op when off. Numbers are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from router.events import Hook, RequestFinished, RequestRouted
from router.model import EngineLoad, KeySource, Reason, ReplicaState, ReplicaStatus
from router.observability.metrics import GatewayMetrics
from router.observability.stats import RollingStats
from router.observability.surface import StatsHook, TracingHook
from router.observability.tracing import NOOP_TRACING, make_tracing

__all__ = ["main", "run"]


def _events(i: int, replicas: int) -> tuple[RequestRouted, RequestFinished]:
    rid = f"10.0.0.{i % replicas}:30000"
    t = i * 0.001
    routed = RequestRouted(
        request_id=f"r{i}",
        at=t,
        route="/v1/chat/completions",
        replica_id=rid,
        reason=Reason.AFFINITY,
        key_source=KeySource.HEADER,
        session_id=f"s{i % 500}",
        scores=((rid, 0.5),),
    )
    done = RequestFinished(
        request_id=f"r{i}",
        at=t + 0.5,
        route="/v1/chat/completions",
        status=200,
        ok=True,
        stream=True,
        replica_id=rid,
        reason=Reason.AFFINITY,
        key_source=KeySource.HEADER,
        session_id=f"s{i % 500}",
        ttft_s=0.08,
        e2e_s=0.5,
        overhead_s=0.0004,
        prompt_tokens=100_000,
        cached_tokens=98_000,
        completion_tokens=300,
    )
    return routed, done


def run(requests: int = 20_000, replicas: int = 50) -> dict[str, Any]:
    metrics = GatewayMetrics()
    stats = RollingStats()
    hooks: list[Hook] = [metrics, StatsHook(stats), TracingHook(NOOP_TRACING)]
    evs = [_events(i, replicas) for i in range(requests)]
    t0 = time.perf_counter()
    for routed, done in evs:
        for h in hooks:
            h(routed)
            h(done)
    hook_s = time.perf_counter() - t0

    reps = [
        ReplicaState(
            id=f"10.0.0.{i}:30000",
            url=f"http://10.0.0.{i}:30000",
            status=ReplicaStatus.ACTIVE,
            in_flight=i % 7,
            engine=EngineLoad(running=3, queued=1, kv_util=0.5, updated_at=1.0),
        )
        for i in range(replicas)
    ]
    n_render = 50
    t0 = time.perf_counter()
    size = 0
    for _ in range(n_render):
        size = len(metrics.render(reps, 2.0))
    render_s = (time.perf_counter() - t0) / n_render

    n_view = 200
    t0 = time.perf_counter()
    for k in range(n_view):
        stats.sample(requests * 0.001 + k, [r.in_flight for r in reps])
        stats.view(requests * 0.001 + k)
    view_s = (time.perf_counter() - t0) / n_view

    out: dict[str, Any] = {
        "requests": requests,
        "replicas": replicas,
        "hooks_us_per_request": round(hook_s / requests * 1e6, 3),
        "metrics_render_ms": round(render_s * 1e3, 3),
        "metrics_body_bytes": size,
        "stats_sample_and_view_ms": round(view_s * 1e3, 3),
    }
    try:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:  # pragma: no cover - without the otel extra
        return out
    tracing = make_tracing(True, exporter=InMemorySpanExporter())
    tracer = tracing.provider.get_tracer("bench")  # type: ignore[attr-defined]
    n_spans = 2_000
    t0 = time.perf_counter()
    for i in range(n_spans):
        with tracer.start_as_current_span("kvroute.request"):
            tracing.annotate({"kvroute.replica": f"r{i % 50}", "kvroute.reason": "affinity"})
            with tracer.start_as_current_span("kvroute.upstream"):
                pass
    out["tracing_on_us_per_request"] = round((time.perf_counter() - t0) / n_spans * 1e6, 3)
    t0 = time.perf_counter()
    for _ in range(n_spans):
        NOOP_TRACING.annotate({"kvroute.replica": "r", "kvroute.reason": "affinity"})
    out["tracing_off_us_per_request"] = round((time.perf_counter() - t0) / n_spans * 1e6, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_observability", description=__doc__)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--replicas", type=int, default=50)
    ns = p.parse_args(argv)
    print(json.dumps(run(ns.requests, ns.replicas), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

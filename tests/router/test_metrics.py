"""GatewayMetrics as a hook over frozen events + scrape-time fleet gauges (no network)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench_observability import run as bench_run
from router.events import (
    AffinityBroken,
    ReplicaEjected,
    RequestFinished,
    RequestRouted,
    ResidencyJudged,
    StoreDegraded,
    UpstreamRetry,
)
from router.model import AffinityBreak, EngineLoad, KeySource, Reason, ReplicaState, ReplicaStatus
from router.observability.metrics import GatewayMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _finished(status: int = 200, **kw: object) -> RequestFinished:
    base: dict[str, object] = {
        "request_id": "x",
        "at": 1.0,
        "route": "/generate",
        "status": status,
        "ok": status == 200,
        "stream": False,
        "replica_id": "r1",
        "reason": Reason.AFFINITY,
        "key_source": KeySource.HEADER,
        "session_id": "secret-session",
        "ttft_s": 0.2,
        "e2e_s": 1.5,
        "overhead_s": 0.0007,
        "prompt_tokens": 1000,
        "cached_tokens": 900,
        "completion_tokens": 10,
    }
    base.update(kw)
    return RequestFinished(**base)  # type: ignore[arg-type]


def test_events_feed_counters_and_histograms() -> None:
    m = GatewayMetrics()
    m(
        RequestRouted(
            request_id="x",
            at=0.0,
            route="/generate",
            replica_id="r1",
            reason=Reason.PLACED_NEW,
            key_source=KeySource.PREFIX,
            session_id=None,
        )
    )
    m(_finished())
    m(_finished())
    m(
        _finished(
            502, reason=None, ttft_s=None, prompt_tokens=None, cached_tokens=None, completion_tokens=None
        )
    )
    m(_finished(usage_estimated=True, cached_tokens=None, client_disconnected=True))
    m(
        AffinityBroken(
            request_id="x",
            at=1.0,
            replica_id="r1",
            session_id="secret-session",
            reason=AffinityBreak.EVICTED,
            expected_cached_tokens=900,
            cached_tokens=0,
        )
    )
    for found in (True, True, False):
        m(ResidencyJudged("x", 1.0, "r1", "events", found, expected_cached_tokens=900, cached_tokens=900 * found))
    m(UpstreamRetry(request_id="x", at=1.0, replica_id="r1", attempt=1, error="upstream_connect_error"))
    m(ReplicaEjected(at=1.0, replica_id="r1", cause="connect"))
    m(StoreDegraded(at=1.0, error="boom"))
    text = m.render([], 2.0).decode()
    s = _samples(text)
    assert (
        s[("kvroute_requests_total", (("reason", "affinity"), ("route", "/generate"), ("status", "200")))]
        == 3
    )
    assert s[("kvroute_requests_total", (("reason", "none"), ("route", "/generate"), ("status", "502")))] == 1
    assert s[("kvroute_routing_decisions_total", (("key_source", "prefix"), ("reason", "placed_new")))] == 1
    assert s[("kvroute_ttft_seconds_count", (("route", "/generate"),))] == 3
    assert s[("kvroute_ttft_seconds_bucket", (("le", "0.25"), ("route", "/generate")))] == 3
    assert s[("kvroute_ttft_seconds_bucket", (("le", "0.1"), ("route", "/generate")))] == 0
    assert s[("kvroute_e2e_seconds_count", (("route", "/generate"),))] == 4
    assert s[("kvroute_gateway_overhead_seconds_bucket", (("le", "0.001"),))] == 4
    assert s[("kvroute_prompt_tokens_total", ())] == 2000  # the estimated one is left out
    assert s[("kvroute_cached_tokens_total", ())] == 1800
    assert s[("kvroute_completion_tokens_total", ())] == 30
    assert s[("kvroute_client_disconnects_total", (("route", "/generate"),))] == 1
    assert s[("kvroute_affinity_breaks_total", (("reason", "evicted"), ("residency", "none")))] == 1
    assert s[("kvroute_residency_outcomes_total", (("found", "true"), ("residency", "events")))] == 2
    assert s[("kvroute_residency_outcomes_total", (("found", "false"), ("residency", "events")))] == 1
    assert s[("kvroute_upstream_retries_total", (("error", "upstream_connect_error"),))] == 1
    assert s[("kvroute_replica_ejections_total", (("cause", "connect"), ("replica", "r1")))] == 1
    assert s[("kvroute_store_degraded_events_total", ())] == 1
    assert "secret-session" not in text
    # no store attributes -> no store gauges; no sampler -> no desired replicas
    assert not any(
        name.startswith(("kvroute_store_degraded", "kvroute_desired"))
        for name, _ in s
        if name != "kvroute_store_degraded_events_total" and not name.endswith("_created")
    )


def test_fleet_gauges_follow_the_replica_list() -> None:
    class FakeRedisFigures:  # the attributes RedisStore exposes
        degraded = True
        degraded_total = 3
        round_trips_total = 42

    m = GatewayMetrics(desired_replicas=lambda reps: len(reps) + 1)
    reps = [
        ReplicaState(
            id="a",
            url="http://a",
            in_flight=4,
            sessions_active=2,
            active_context_tokens=5000,
            engine=EngineLoad(
                running=3, queued=2, kv_util=0.7, capacity_tokens=1000, cache_hit_rate=0.9, updated_at=9.0
            ),
        ),
        ReplicaState(id="b", url="http://b", status=ReplicaStatus.DRAINING, in_flight=1),
        ReplicaState(id="c", url="http://c", in_flight=0),
    ]
    s = _samples(m.render(reps, 10.0, FakeRedisFigures()).decode())
    assert s[("kvroute_replica_in_flight_requests", (("replica", "a"),))] == 4
    assert s[("kvroute_replica_status", (("replica", "b"), ("status", "draining")))] == 1
    assert s[("kvroute_replica_status", (("replica", "b"), ("status", "active")))] == 0
    assert s[("kvroute_engine_queued_requests", (("replica", "a"),))] == 2
    assert s[("kvroute_engine_kv_utilization_ratio", (("replica", "a"),))] == 0.7
    assert s[("kvroute_engine_scrape_age_seconds", (("replica", "a"),))] == 1.0
    assert ("kvroute_engine_scrape_age_seconds", (("replica", "b"),)) not in s  # never scraped
    assert s[("kvroute_sessions_active", ())] == 2 and s[("kvroute_in_flight_requests", ())] == 5
    assert s[("kvroute_replicas_active", ())] == 2
    assert s[("kvroute_load_dispersion_ratio", ())] == 2.0  # ACTIVE loads [4, 0]
    assert s[("kvroute_store_degraded", ())] == 1 and s[("kvroute_store_degradations_total", ())] == 3
    assert s[("kvroute_store_round_trips_total", ())] == 42
    assert s[("kvroute_desired_replicas", ())] == 4
    # a removed replica's series disappear
    s2 = _samples(m.render(reps[:1], 10.0).decode())
    assert ("kvroute_replica_in_flight_requests", (("replica", "c"),)) not in s2


def test_registries_are_per_app() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a(_finished())
    assert "kvroute_requests_total{" in a.render([], 0).decode()
    assert "kvroute_requests_total{" not in b.render([], 0).decode()


def test_bench_reports_json_numbers() -> None:
    out = bench_run(requests=200, replicas=5)
    assert out["requests"] == 200 and out["hooks_us_per_request"] > 0 and out["metrics_render_ms"] > 0
    assert out["tracing_off_us_per_request"] < out["tracing_on_us_per_request"]

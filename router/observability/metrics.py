"""Prometheus metrics for the gateway: event hooks + a scrape-time collector over the store.

Rules:
  1. Everything lives in a per-app ``CollectorRegistry`` (tests build many gateways in one process).
  2. Names start with ``kvroute_`` and carry their unit (``_seconds``, ``_tokens``, ``_ratio``,
     ``_total``). Labels are low-cardinality: route, reason, status, error code, replica id (bounded
     by the fleet size). Session ids and request ids never become labels.
  3. Counters and histograms are fed by :class:`GatewayMetrics` as a ``Hook`` over the gateway's
     frozen events (``router.events``). Gauges that describe the fleet (per-replica in-flight, KV
     utilisation, sessions, re-exported engine gauges, dispersion, store degradation, desired
     replicas) are computed at scrape time from ``StateStore.replicas()`` by :meth:`GatewayMetrics.render`,
     so a removed replica's series disappear instead of going stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from router.events import (
    AffinityBroken,
    Event,
    ReplicaActivated,
    ReplicaEjected,
    ReplicaReadmitted,
    RequestFinished,
    RequestRouted,
    ResidencyJudged,
    StoreDegraded,
    StoreRecovered,
    UpstreamRetry,
)
from router.model import Reason, ReplicaState, ReplicaStatus
from router.observability.stats import dispersion

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "OVERHEAD_BUCKETS_S",
    "DesiredReplicasFn",
    "FleetCollector",
    "GatewayMetrics",
]

# The classic text format every Prometheus (and SGLang-style scraper) understands.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
    7.0,
    10.0,
    20.0,
    40.0,
    70.0,
    120.0,
    300.0,
    600.0,
)
OVERHEAD_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

DesiredReplicasFn = Callable[[Sequence[ReplicaState]], float | int | None]
"""Maps the fleet to the autoscaling signal (``router.autoscale``); ``None`` = no opinion."""


@dataclass(frozen=True, slots=True)
class _StoreFigures:
    degraded: bool | None
    degraded_total: int | None
    round_trips_total: int | None


def _store_figures(store: Any) -> _StoreFigures:
    """Optional attributes a store may expose (the Redis store does); memory stores have none."""

    def _int(*names: str) -> int | None:
        for name in names:
            val = getattr(store, name, None)
            if isinstance(val, int | float) and not isinstance(val, bool):
                return int(val)
        return None

    deg = getattr(store, "degraded", None)
    return _StoreFigures(
        degraded=deg if isinstance(deg, bool) else None,
        degraded_total=_int("degraded_total"),
        round_trips_total=_int("round_trips_total", "round_trips"),
    )


_PER_REPLICA_GAUGES: tuple[tuple[str, str, Callable[[ReplicaState], float]], ...] = (
    (
        "kvroute_replica_in_flight_requests",
        "Requests in flight on the replica, counted by all gateways",
        lambda r: r.in_flight,
    ),
    (
        "kvroute_replica_kv_utilization_ratio",
        "KV cache utilisation reported by the engine (0..1)",
        lambda r: r.engine.kv_util,
    ),
    (
        "kvroute_replica_sessions_active",
        "Sessions homed on the replica and active in the window",
        lambda r: r.sessions_active,
    ),
    (
        "kvroute_replica_active_context_tokens",
        "Context tokens of the replica's active sessions",
        lambda r: r.active_context_tokens,
    ),
    (
        "kvroute_replica_capacity_tokens",
        "KV capacity in HBM used by the policy (tokens)",
        lambda r: r.capacity_tokens,
    ),
    # engine gauges re-exported (scraped from the replica's /metrics; a little stale)
    ("kvroute_engine_running_requests", "sglang:num_running_reqs of the replica", lambda r: r.engine.running),
    ("kvroute_engine_queued_requests", "sglang:num_queue_reqs of the replica", lambda r: r.engine.queued),
    ("kvroute_engine_kv_utilization_ratio", "sglang:token_usage of the replica", lambda r: r.engine.kv_util),
    (
        "kvroute_engine_max_total_tokens",
        "sglang:max_total_num_tokens of the replica",
        lambda r: r.engine.capacity_tokens,
    ),
    (
        "kvroute_engine_cache_hit_ratio",
        "sglang:cache_hit_rate of the replica",
        lambda r: r.engine.cache_hit_rate,
    ),
    (
        "kvroute_engine_host_used_tokens",
        "sglang:hicache_host_used_tokens of the replica",
        lambda r: r.engine.host_used_tokens,
    ),
    (
        "kvroute_engine_host_total_tokens",
        "sglang:hicache_host_total_tokens of the replica",
        lambda r: r.engine.host_capacity_tokens,
    ),
    (
        "kvroute_engine_gen_throughput_tokens_per_second",
        "sglang:gen_throughput of the replica",
        lambda r: r.engine.gen_throughput,
    ),
)
"""(name, help, value) of the per-replica gauges, labelled ``replica``."""


class FleetCollector(Collector):
    """Scrape-time gauges from the last replica list handed to :meth:`update`."""

    def __init__(self, desired_replicas: DesiredReplicasFn | None = None) -> None:
        self._replicas: tuple[ReplicaState, ...] = ()
        self._now = 0.0
        self._store = _StoreFigures(None, None, None)
        self._desired = desired_replicas

    def update(self, replicas: Sequence[ReplicaState], now: float, store: Any = None) -> None:
        self._replicas = tuple(replicas)
        self._now = now
        self._store = _store_figures(store)

    def collect(self) -> Iterator[Metric]:
        reps = self._replicas
        lab = ["replica"]

        def gauge(name: str, doc: str, value: Callable[[ReplicaState], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lab)
            for r in reps:
                g.add_metric([r.id], float(value(r)))
            return g

        status = GaugeMetricFamily(
            "kvroute_replica_status",
            "1 for the replica's current state, 0 for the others",
            labels=["replica", "status"],
        )
        for r in reps:
            for st in ReplicaStatus:
                status.add_metric([r.id, st.value], 1.0 if r.status is st else 0.0)
        yield status
        for name, doc, value in _PER_REPLICA_GAUGES:
            yield gauge(name, doc, value)
        age = GaugeMetricFamily(
            "kvroute_engine_scrape_age_seconds", "Seconds since the engine was last scraped", labels=lab
        )
        for r in reps:
            if r.engine.updated_at > 0:
                age.add_metric([r.id], max(0.0, self._now - r.engine.updated_at))
        yield age

        active = [r for r in reps if r.status is ReplicaStatus.ACTIVE]
        yield GaugeMetricFamily("kvroute_replicas", "Replicas known to the gateway", value=len(reps))
        yield GaugeMetricFamily("kvroute_replicas_active", "Replicas in the ACTIVE state", value=len(active))
        yield GaugeMetricFamily(
            "kvroute_sessions_active",
            "Sessions active in the window, fleet-wide",
            value=sum(r.sessions_active for r in reps),
        )
        yield GaugeMetricFamily(
            "kvroute_in_flight_requests",
            "Requests in flight, fleet-wide",
            value=sum(r.in_flight for r in reps),
        )
        yield GaugeMetricFamily(
            "kvroute_load_dispersion_ratio",
            "Variance / mean of in-flight requests over ACTIVE replicas (now)",
            value=dispersion(r.in_flight for r in active),
        )
        figs = self._store
        if figs.degraded is not None:
            yield GaugeMetricFamily(
                "kvroute_store_degraded",
                "1 while the shared store is unreachable",
                value=1.0 if figs.degraded else 0.0,
            )
        if figs.degraded_total is not None:
            c = CounterMetricFamily("kvroute_store_degradations", "Times the shared store became unreachable")
            c.add_metric([], float(figs.degraded_total))
            yield c
        if figs.round_trips_total is not None:
            c = CounterMetricFamily("kvroute_store_round_trips", "Round trips to the shared store (Redis)")
            c.add_metric([], float(figs.round_trips_total))
            yield c
        if self._desired is not None:
            want = self._desired(reps)
            if want is not None:
                yield GaugeMetricFamily(
                    "kvroute_desired_replicas",
                    "Replicas the fleet should have (autoscaling signal)",
                    value=float(want),
                )


class _SourcedCollector(Collector):
    """Scrape-time counters read from an object the gateway sets later (``source``; nothing is
    exported while it returns ``None``)."""

    def __init__(self) -> None:
        self.source: Callable[[], Any] = lambda: None

    def collect(self) -> Iterator[Metric]:
        obj = self.source()
        if obj is not None:
            yield self.family(obj)

    def family(self, obj: Any) -> Metric:
        raise NotImplementedError


class DiscoveryCollector(_SourcedCollector):
    """Scrape-time counters of the gateway's discovery (``router.discovery``, the ``source``): its
    health checks and scrapes by outcome, ``shared`` = left alone because someone else's was fresh
    (rules 6 and 7)."""

    def family(self, obj: Any) -> Metric:
        d = obj
        c = CounterMetricFamily(
            "kvroute_discovery_probes",
            "Health checks and /metrics scrapes of this gateway's discovery, by outcome "
            "(shared: not made, someone else's fresh one stood)",
            labels=["probe", "outcome"],
        )
        for probe, outcome, n in (
            ("health", "ok", d.health_ok),
            ("health", "failed", d.health_failures),
            ("health", "busy", d.health_busy),
            ("health", "shared", d.health_shared),
            ("scrape", "ok", d.scrapes_ok),
            ("scrape", "failed", d.scrapes_failed),
            ("scrape", "shared", d.scrapes_shared),
        ):
            c.add_metric([probe, outcome], float(n))
        return c


class HandoffCollector(_SourcedCollector):
    """Scrape-time counters of the warm hand-off of draining replicas' sessions (``router.handoff``;
    the ``source`` is its ``HandoffStats``, None when off): one sample per field."""

    def family(self, obj: Any) -> Metric:
        c = CounterMetricFamily(
            "kvroute_handoffs",
            "Warm hand-offs of idle sessions on draining replicas, by outcome (sent, failed, skipped_*; "
            "and at the session's next turn: helped, not_helped, missed)",
            labels=["outcome"],
        )
        for outcome, n in obj.to_dict().items():
            c.add_metric([outcome], float(n))
        return c


# the subscribers' counters exported per replica (summed over its DP ranks); the rest of
# SubscriberStats (sequence numbers, timings) is on GET /admin/kv-events
KV_EVENT_COUNTERS = (
    "batches", "syncs", "rebuilds", "replay_failures", "replay_resumes", "gaps", "gaps_unrecovered",
    "restarts", "decode_errors", "connects", "disconnects",
)  # fmt: skip


class KvEventsCollector(_SourcedCollector):
    """Scrape-time figures of exact residency (``router.gateway.residency``; the ``source`` is its
    ``stats()``): each replica's mirror source, whether its subscribers are connected, and their
    counters, so an operator can alert on a replica that fell back to the estimate."""

    def collect(self) -> Iterator[Metric]:
        obj = self.source()
        if not obj:
            return
        replicas = obj.get("replicas") or {}
        source = GaugeMetricFamily(
            "kvroute_replica_residency_source",
            "1 for where the replica's residency comes from: events (a complete mirror) or estimate",
            labels=["replica", "source"],
        )
        for rid, view in replicas.items():
            source.add_metric([rid, str(view["source"])], 1.0)
        yield source
        subs = obj.get("subscribers") or {}
        connected = GaugeMetricFamily(
            "kvroute_kv_events_connected", "The replica's event subscribers (DP ranks) now connected", labels=["replica"]
        )
        counters = CounterMetricFamily(
            "kvroute_kv_events",
            "KV-event subscriber counters by replica (summed over its DP ranks): batches applied, syncs, rebuilds "
            "from sequence 0, replay failures and resumes, gaps (unrecovered), publisher restarts, decode errors, "
            "connects, disconnects",
            labels=["replica", "kind"],
        )
        for rid, sub in subs.items():
            ranks = sub["ranks"]
            connected.add_metric([rid], float(sum(1 for r in ranks if r["connected"])))
            for kind in KV_EVENT_COUNTERS:
                counters.add_metric([rid, kind], float(sum(r[kind] for r in ranks)))
        yield connected
        yield counters


class GatewayMetrics:
    """All gateway metrics in one registry. Call it with events (it is a ``Hook``)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        desired_replicas: DesiredReplicasFn | None = None,
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests finished, by route, routing reason and HTTP status",
            ["route", "reason", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_routing_decisions",
            "Routing decisions (one per attempt), by reason and key source",
            ["reason", "key_source"],
            registry=r,
        )
        self.disagreements = Counter(
            "kvroute_gateway_disagreements",
            "Decisions overridden by the store (another gateway bound first)",
            registry=r,
        )
        self.affinity_breaks = Counter(
            "kvroute_affinity_breaks",
            "Responses whose cached tokens fell short of the session context, by reason and by the "
            "residency the decision went by (events: the engine's KV events; estimate; none)",
            ["reason", "residency"],
            registry=r,
        )
        self.residency_checks = Counter(
            "kvroute_residency_checks",
            "Decisions on a session whose residency the engine's KV events told exactly: whether the "
            "estimate would have judged the same (agree, false_gone: it thought the cache gone, "
            "false_resident: it thought it there)",
            ["verdict"],
            registry=r,
        )
        self.residency_outcomes = Counter(
            "kvroute_residency_outcomes",
            "Requests sent home for their session's cache (affinity) that continued its context: whether "
            "the engine found it cached (found: true/false), by the residency the decision went by "
            "(events: the engine's KV events; estimate)",
            ["residency", "found"],
            registry=r,
        )
        self.panic_routes = Counter(
            "kvroute_panic_routes",
            "Attempts sent to a replica marked DOWN because none looked healthy (panic routing)",
            registry=r,
        )
        self.retries = Counter(
            "kvroute_upstream_retries",
            "Attempts that failed before the first byte and were retried, by error",
            ["error"],
            registry=r,
        )
        self.ejections = Counter(
            "kvroute_replica_ejections",
            "Replicas taken out of rotation, by cause",
            ["replica", "cause"],
            registry=r,
        )
        self.readmissions = Counter(
            "kvroute_replica_readmissions",
            "Replicas put back into rotation",
            ["replica"],
            registry=r,
        )
        self.activations = Counter(
            "kvroute_replica_activations",
            "Replicas that became ACTIVE after joining",
            ["replica"],
            registry=r,
        )
        self.store_degradations = Counter(
            "kvroute_store_degraded_events",
            "Store degradation events seen by this gateway",
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvroute_client_disconnects",
            "Requests whose client went away before the end",
            ["route"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens",
            "Prompt tokens reported by replicas (responses with usage)",
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvroute_cached_tokens",
            "Cached prompt tokens reported by replicas",
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvroute_completion_tokens",
            "Completion tokens reported by replicas",
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Gateway-observed time to first byte to the client",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "kvroute_e2e_seconds",
            "Gateway-observed request duration",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.overhead = Histogram(
            "kvroute_gateway_overhead_seconds",
            "Time spent in the gateway itself (excluding upstream waits)",
            buckets=OVERHEAD_BUCKETS_S,
            registry=r,
        )
        self.http_responses = Counter(
            "kvroute_http_responses",
            "HTTP responses of the gateway by matched route, method and status (incl. early 4xx rejections)",
            ["route", "method", "status"],
            registry=r,
        )
        self.fleet = FleetCollector(desired_replicas)
        r.register(self.fleet)
        self.discovery = DiscoveryCollector()
        r.register(self.discovery)
        self.handoff = HandoffCollector()
        r.register(self.handoff)
        self.kv_events = KvEventsCollector()
        r.register(self.kv_events)
        # labelled children of the per-request series, cached: labels() costs more than inc()
        self._children: dict[tuple[str, ...], Any] = {}
        self._finished: dict[tuple[str, Reason | None, int], tuple[Any, Any, Any]] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (str(id(metric)), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestFinished):
            # one dict lookup for the three labelled children of this (route, reason, status)
            key = (event.route, event.reason, event.status)
            kids = self._finished.get(key)
            if kids is None:
                reason = event.reason.value if event.reason is not None else "none"
                kids = self._finished[key] = (
                    self._child(self.requests, event.route, reason, str(event.status)),
                    self._child(self.ttft, event.route),
                    self._child(self.e2e, event.route),
                )
            requests, ttft, e2e = kids
            requests.inc()
            if event.ttft_s is not None:
                ttft.observe(event.ttft_s)
            e2e.observe(event.e2e_s)
            self.overhead.observe(event.overhead_s)
            if event.client_disconnected:
                self.client_disconnects.labels(event.route).inc()
            if event.prompt_tokens is not None and not event.usage_estimated:
                self.prompt_tokens.inc(event.prompt_tokens)
                if event.cached_tokens is not None:
                    self.cached_tokens.inc(event.cached_tokens)
            if event.completion_tokens is not None:
                self.completion_tokens.inc(event.completion_tokens)
        elif isinstance(event, RequestRouted):
            self._child(self.decisions, event.reason.value, event.key_source.value).inc()
            if event.disagreement:
                self.disagreements.inc()
            if event.estimate_check:
                self.residency_checks.labels(event.estimate_check).inc()
            if event.panic:
                self.panic_routes.inc()
        elif isinstance(event, AffinityBroken):
            self.affinity_breaks.labels(event.reason.value, event.residency or "none").inc()
        elif isinstance(event, ResidencyJudged):
            self.residency_outcomes.labels(event.residency, "true" if event.found else "false").inc()
        elif isinstance(event, UpstreamRetry):
            self.retries.labels(event.error).inc()
        elif isinstance(event, ReplicaEjected):
            self.ejections.labels(event.replica_id, event.cause).inc()
        elif isinstance(event, ReplicaReadmitted):
            self.readmissions.labels(event.replica_id).inc()
        elif isinstance(event, ReplicaActivated):
            self.activations.labels(event.replica_id).inc()
        elif isinstance(event, StoreDegraded):
            self.store_degradations.inc()
        elif isinstance(event, StoreRecovered):
            pass

    def response_observer(self) -> Callable[[str, str, int | str], None]:
        """``(route, method, status)`` -> count one HTTP response (route = the matched resource's
        template, never the raw path): an observer of ``router.gateway.middleware.GatewayMiddleware``,
        which wraps every request already (no middleware layer of its own)."""
        counter = self.http_responses
        children: dict[tuple[str, str, int | str], Any] = {}  # labels() costs more than inc()

        def observe(route: str, method: str, status: int | str) -> None:
            key = (route, method, status)
            child = children.get(key)
            if child is None:
                child = children[key] = counter.labels(route, method, str(status))
            child.inc()

        return observe

    def render(self, replicas: Iterable[ReplicaState], now: float, store: Any = None) -> bytes:
        """Prometheus text exposition (format 0.0.4) with fleet gauges as of ``replicas``."""
        self.fleet.update(tuple(replicas), now, store)
        return generate_latest(self.registry)

"""Prometheus exposition of one emulated replica, with SGLang's metric names (``sglang:`` prefix).

A custom collector over plain counters: no ``_created`` samples (SGLang's multiprocess registry
has none), gauges read from the engine at scrape time, and a per-app ``CollectorRegistry`` so
several replicas can live in one process.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_go_float

from replica.emulator.timemodel import EngineLoad

__all__ = ["CONTENT_TYPE", "E2E_BUCKETS", "QUEUE_BUCKETS", "TTFT_BUCKETS", "Histogram", "ReplicaMetrics"]

_go_float: Callable[[float], str] = _untyped_go_float  # the library's own value formatting
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0,
)
E2E_BUCKETS: tuple[float, ...] = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0,
    600.0, 1200.0, 1800.0, 2400.0,
)

QUEUE_BUCKETS: tuple[float, ...] = (
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 70.0, 80.0, 90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0,
    1400.0, 1600.0, 1800.0, 2000.0, 2500.0, 3000.0,
)  # fmt: skip
"""``sglang:queue_time_seconds``' bucket bounds, as SGLang 0.5.x's scheduler (``SchedulerMetricsCollector``)."""


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((repr(float(b)), float(acc)))
        out.append(("+Inf", float(acc + self.counts[-1])))
        return out


class _Families(Collector):
    """Already collected families, for one ``generate_latest`` call."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _layout(text: str, n_samples: int) -> list[tuple[str, bool]]:
    """The exposition as pieces: comment lines whole, sample lines up to their value."""
    pieces: list[tuple[str, bool]] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            pieces.append((line, False))
        else:
            pieces.append((line[: line.rindex(" ") + 1], True))
    if sum(1 for _, is_sample in pieces if is_sample) != n_samples:  # pragma: no cover - no timestamps here
        raise RuntimeError("exposition layout does not match the collected samples")
    return pieces


_SCHEDULER_GAUGES: tuple[tuple[str, str, Callable[[EngineLoad], float]], ...] = (
    ("num_running_reqs", "The number of running requests.", lambda x: x.running),
    ("num_queue_reqs", "The number of requests in the waiting queue.", lambda x: x.queued),
    ("gen_throughput", "The generation throughput (token/s).", lambda x: x.gen_throughput),
    ("cache_hit_rate", "The prefix cache hit rate.", lambda x: x.cache_hit_rate),
    ("token_usage", "The token usage.", lambda x: x.token_usage),
    ("num_used_tokens", "The number of used tokens.", lambda x: x.used_tokens),
    ("kv_used_tokens", "Number of locked (in-use) token slots in the KV cache pool.",
     lambda x: x.used_tokens - x.evictable_tokens),
    ("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool.",
     lambda x: x.evictable_tokens),
    ("kv_available_tokens", "Number of free token slots in the KV cache pool.",
     lambda x: x.capacity_tokens - x.used_tokens),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", lambda x: x.capacity_tokens),
    ("decode_sum_seq_lens", "The sum of all sequence lengths in the decode batch.", lambda x: x.decode_sum_seq_lens),
    ("spec_accept_length",
     "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
     lambda x: x.spec_accept_length),
    ("hicache_host_used_tokens", "Number of tokens currently used in the host KV cache.",
     lambda x: x.host_used_tokens),
    ("hicache_host_total_tokens", "Total capacity of the host KV cache in tokens.", lambda x: x.host_total_tokens),
)
"""The scheduler's gauges: (name, help, the figure of the rank's load); ``hicache_*`` with a host tier only."""


class ReplicaMetrics(Collector):
    """Counters the HTTP shell bumps, plus gauges pulled from ``load_fn`` at scrape time."""

    def __init__(
        self, model_name: str, load_fns: Sequence[Callable[[], EngineLoad]], hicache: bool, tp_size: int = 1
    ) -> None:
        """``load_fns``: each data-parallel rank's load; with more than one, the scheduler's series
        carry a ``dp_rank`` label, as SGLang's (the tokenizer's request series do not)."""
        self.model_name = model_name
        self._load_fns = list(load_fns)
        self._hicache = hicache
        self._tp_size = tp_size
        self.prompt_tokens = {"true": 0, "false": 0}
        self.generation_tokens = {"true": 0, "false": 0}
        self.num_requests = {"true": 0, "false": 0}
        self.cached_tokens = {"device": 0, "host": 0}
        self.aborted = 0
        self.ttft = {"true": Histogram(TTFT_BUCKETS), "false": Histogram(TTFT_BUCKETS)}
        self.e2e = {"true": Histogram(E2E_BUCKETS), "false": Histogram(E2E_BUCKETS)}
        # each request's wait from entering the queue to its first prefill forward (admission), as
        # SGLang's scheduler observes it once per request; per rank, labelled like its gauges
        self.queue_time = [Histogram(QUEUE_BUCKETS) for _ in self._load_fns]
        self.http_active: dict[tuple[str, str], int] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._layout_key: tuple[tuple[object, ...], ...] | None = None
        self._layout: list[tuple[str, bool]] = []

    def render(self) -> bytes:
        """``generate_latest(self.registry)``, byte for byte, in a fifth of the time.

        The emulator serves every replica of a fleet from one event loop, which a gateway scrapes
        often at a fast time scale: prometheus_client's per-sample label escaping would take a large
        share of that loop and delay every replica's tokens. The exposition's layout (families, sample names and labels) only changes when a new
        label set appears, so the library renders it once and each scrape fills in the values."""
        families = list(self.collect())
        values = [s.value for f in families for s in f.samples]
        key = tuple((s.name, *s.labels.values()) for f in families for s in f.samples)
        if key != self._layout_key:
            self._layout = _layout(generate_latest(_Families(families)).decode(), len(values))
            self._layout_key = key
        out: list[str] = []
        vi = iter(values)
        for piece, is_sample in self._layout:
            out.append(f"{piece}{_go_float(next(vi))}\n" if is_sample else piece)
        return "".join(out).encode()

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        dp = len(self._load_fns) > 1
        sched_labels = ["engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"]
        if dp:
            sched_labels.insert(0, "dp_rank")
        ranks = [
            ([str(i)] if dp else [], ["unified", m, "0", "0", "0"], fn()) for i, fn in enumerate(self._load_fns)
        ]
        for name, doc, value_of in _SCHEDULER_GAUGES:
            if name.startswith("hicache_") and not self._hicache:
                continue
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=sched_labels)
            for rank_label, sched_vals, load in ranks:
                g.add_metric([*rank_label, *sched_vals], float(value_of(load)))
                if name == "max_total_num_tokens":  # every TP rank reports the pool they share (a real --tp-size 2)
                    for tp in range(1, self._tp_size):
                        g.add_metric([*rank_label, *sched_vals[:-1], str(tp)], float(value_of(load)))
            yield g
        h = HistogramMetricFamily("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                  labels=sched_labels)
        for (rank_label, sched_vals, _), hist in zip(ranks, self.queue_time, strict=True):
            h.add_metric([*rank_label, *sched_vals], hist.buckets(), hist.total)
        yield h

        req_labels = ["engine_type", "is_streaming", "model_name"]
        for name, doc, series in (
            ("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ("num_requests", "Number of requests processed.", self.num_requests),
        ):
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=req_labels)
            for streaming, v in series.items():
                c.add_metric(["unified", streaming, m], float(v))
            yield c
        c = CounterMetricFamily(
            "sglang:cached_tokens", "Number of cached prompt tokens by source (device/host/storage).",
            labels=["cache_source", "engine_type", "model_name"],
        )
        for source, v in self.cached_tokens.items():
            c.add_metric([source, "unified", m], float(v))
        yield c
        c = CounterMetricFamily("sglang:num_aborted_requests", "Number of requests aborted.",
                                labels=["engine_type", "model_name"])
        c.add_metric(["unified", m], float(self.aborted))
        yield c
        for name, doc, hists in (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", self.e2e),
        ):
            h = HistogramMetricFamily(f"sglang:{name}", doc, labels=req_labels)
            for streaming, hist in hists.items():
                if any(hist.counts):  # as SGLang: a label set's series appears at its first observation
                    h.add_metric(["unified", streaming, m], hist.buckets(), hist.total)
            yield h
        g = GaugeMetricFamily("sglang:http_requests_active", "Number of currently active HTTP requests",
                              labels=["endpoint", "method"])
        for (endpoint, method), n in sorted(self.http_active.items()):
            g.add_metric([endpoint, method], float(n))
        yield g

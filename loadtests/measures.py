"""The benchmark measures (CHR, dispersion, TTFT, breaks, ...; docs/BENCHMARKS.md), computed the same way for the simulator and the live load driver.

Feed a ``MeasureCollector`` with one ``RequestRecord`` per finished request and with periodic
per-replica in-flight samples, then call ``result()``. Pure: no clock, no I/O.

Definitions (exact, so that tests can pin them):
  * measured window: records with ``t_start >= warmup_s`` (and ``< end_s`` if given); samples with
    ``warmup_s <= t`` (``< end_s``). Warm-up is excluded from every figure, counters included.
  * ``chr`` = Σ cached_tokens / Σ input_tokens over ok records; ``ideal_chr`` = Σ ideal_cached /
    Σ input over the same records (``ideal_cached_tokens``: what one infinite cache would have hit).
  * ``dispersion`` = population variance / mean of the pooled per-replica in-flight values of all
    samples in the window (None if there are none or the mean is 0); ``p_load_le1`` /
    ``p_load_ge12`` = fraction of pooled values ``<= 1`` / ``>= 12``.
  * percentiles interpolate linearly between closest ranks (numpy's default); ``ttft_*`` and
    ``e2e_*`` over ok records; ``tps_user_p50`` = median over ok records with output > 1 token and
    e2e > ttft of ``output_tokens / (e2e_s - ttft_s)`` (decode speed one user sees).
  * ``throughput_tok_s_per_replica`` = Σ (input + output) of ok records / window length / replicas;
    window length = (``end_s`` or the last record's end) - ``warmup_s``; replicas = the mean number
    of replicas per sample (or the ``replicas`` given to the constructor when there are no samples).
  * ``cold_prefill_tokens`` = Σ max(0, ideal_cached - cached) over ok records: tokens recomputed
    that an infinite cache would have served (evictions, moves, spills); ``cold_prefill_by_cause`` =
    the same sum per ``break_reason`` (``"none"``: records that are no affinity break, e.g. first
    turns whose shared prefix was evicted, or hits short of the ideal by less than the tolerance);
    ``cold_prefill_by_route`` = the same sum per ``route_reason`` (the router's own decision, e.g.
    kvroute's ``placed_evicted``: moved because its cache at home was gone; records without one
    count under ``"none"``; empty when no record has one, as for the peers).
  * ``affinity_breaks`` = count of records by ``break_reason`` (records with a reason only).
  * ``sessions_moved`` / ``sessions_moved_by_scaleup``: counted by the driver (home changes) via
    ``session_moved``; only moves at ``t >= warmup_s`` count. The simulator counts a move as by
    the scale-up when its new home joined by scale-up and the session did not have to move anyway
    (kvroute's ``placed_evicted``, ``reassigned_gone``, ``reassigned_draining``).
  * ``gateway_overhead_*_ms``: percentiles of ``add_gateway_overhead`` samples; None when none.
  * ``dispersion_floor`` = 1 - Σf² / Σf over sessions, f = the fraction of the measured window in
    which the session had at least one request in flight (the union of its records'
    ``[t_start, t_start + e2e_s]``, clipped to the window). It is the dispersion of sticky
    placement if every replica's load were a sum of independent sessions with equal means (the
    binomial floor): what the workload allows without moving warm sessions. None without records
    or without a window end.
  * ``dispersion_sticky`` = Σ Var(X_s) / Σ E[X_s] over sessions, X_s(t) = the number of the session's
    requests in flight at t (from the same clipped spans; E and Var over the window). The dispersion
    of sticky placement of whole, independent sessions counting each session's *parallel* requests
    (sub-agents): ``dispersion`` counts requests, while ``dispersion_floor`` counts a busy session
    once, so the two are equal only when no session ever has two requests in flight. A router that
    splits bursty sessions (rule 2) can go below it; what a router leaves above it is between-replica
    imbalance plus sessions on one replica moving together (a long prefill slows them all).
  * ``dispersion_between`` = Σ_r n_r (m_r - m)² / N / m over replicas r, m_r = r's mean sampled load,
    n_r its samples, m and N over all: the part of ``dispersion`` that comes from replicas carrying
    different average loads (placement). The rest (``dispersion - dispersion_between``) is each
    replica's own load varying over time, which placement cannot even out (on a KV-bound fleet: one
    replica's cold prefills slow all its sessions at once). None without samples.
  * ``pooled_chr`` = Σ pooled_cached / Σ input over ok records (``pooled_cached_tokens``: what one
    shared LRU cache of the fleet's total KV would have hit, ``loadtests.ideal.PooledCache``);
    ``routing_loss`` = ``pooled_chr - chr``. None when a record has no pooled figure.
    ``ttft_floor_p99_s`` = the 99th percentile, over ok records that have one, of ``floor_ttft_s``:
    each request's TTFT alone on an idle replica holding what that shared LRU held for it
    (``replica.emulator.timemodel.alone_ttft_s`` of its prompt and ``pooled_cached_tokens``). What
    a router's TTFT p99 would be with this memory if no request ever waited for another; the rest
    is queueing. None when no record has one (a fleet whose time model is unknown).
    ``routing_loss_by_route`` = Σ (pooled_cached - cached) / Σ input per ``route_reason``: the
    routing loss split by the decision that placed each request (its values sum to
    ``routing_loss``; a decision can be negative where it hit more than the shared pool would).
    Empty when no record has a reason or ``routing_loss`` is None.
  * ``engine_queue_*``: from the engines' own histograms, the fleet's totals read at the start and
    at the end of the measured window (``set_engine_queue``; SGLang's ``sglang:queue_time_seconds``,
    each request's wait from entering the engine's queue to its first forward, and
    ``sglang:time_to_first_token_seconds``), differenced: ``engine_queue_mean_s`` = Δsum / Δcount
    of the queue time; ``engine_queue_p99_s`` = its 99th percentile from the Δ bucket counts
    (Prometheus' ``histogram_quantile``: linear within the bucket; the highest finite bound if it
    falls in +Inf); ``engine_queue_share`` = Δ queue sum / Δ TTFT sum, the share of the engines'
    time to first token spent waiting (for free KV or behind other prefills) rather than computing.
    None when the engines do not report them or nothing was observed in between.
  * ``lanes_spent``: lanes (a driver that keeps N sessions alive runs the workload's sessions back to
    back in N lanes) whose sessions ran out before the measured window ended (``lane_spent``, at any
    time before ``end_s``). A spent lane sends nothing more, so ``requests`` then measures the
    workload's pool as well as the router: a router that serves a lane faster empties it sooner.
    None when the driver runs no lanes (``lanes`` not given to the constructor).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MEASURE_FIELDS",
    "EngineQueue",
    "MeasureCollector",
    "RequestRecord",
    "engine_queue_measures",
    "histogram_quantile",
    "percentile",
]

MEASURE_FIELDS: tuple[str, ...] = (
    "chr",
    "ideal_chr",
    "dispersion",
    "p_load_le1",
    "p_load_ge12",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_floor_p99_s",
    "e2e_p99_s",
    "tps_user_p50",
    "throughput_tok_s_per_replica",
    "affinity_breaks",
    "cold_prefill_tokens",
    "cold_prefill_by_cause",
    "cold_prefill_by_route",
    "sessions_moved",
    "sessions_moved_by_scaleup",
    "gateway_overhead_p50_ms",
    "gateway_overhead_p99_ms",
    "requests",
    "errors",
    "dispersion_floor",
    "dispersion_sticky",
    "dispersion_between",
    "pooled_chr",
    "routing_loss",
    "routing_loss_by_route",
    "engine_queue_mean_s",
    "engine_queue_p99_s",
    "engine_queue_share",
    "lanes_spent",
)


@dataclass(frozen=True, slots=True)
class EngineQueue:
    """A fleet's engine-reported queue and TTFT totals at one moment (summed over replicas and label
    sets): the queue-time histogram as ``(upper bound, cumulative count)`` pairs ending with
    ``(inf, count)``, its sum, and the TTFT histogram's sum and count."""

    buckets: tuple[tuple[float, float], ...]
    queue_sum: float
    queue_count: float
    ttft_sum: float
    ttft_count: float


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over ``(upper bound, cumulative count)`` pairs sorted by bound
    (the last one +Inf): linear interpolation inside the bucket the rank falls in, from the previous
    bound (0 for the first); the highest finite bound if it falls in +Inf. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def engine_queue_measures(before: EngineQueue | None, after: EngineQueue | None) -> dict[str, float | None]:
    """``engine_queue_*`` (module docstring) from two readings; ``before`` None = from zero."""
    none: dict[str, float | None] = {"engine_queue_mean_s": None, "engine_queue_p99_s": None, "engine_queue_share": None}
    if after is None:
        return none
    before = before or EngineQueue((), 0.0, 0.0, 0.0, 0.0)
    b0 = dict(before.buckets)
    buckets = tuple((ub, c - b0.get(ub, 0.0)) for ub, c in after.buckets)
    dq, dn, dt = after.queue_sum - before.queue_sum, after.queue_count - before.queue_count, after.ttft_sum - before.ttft_sum
    if dn <= 0:
        return none
    return {
        "engine_queue_mean_s": dq / dn,
        "engine_queue_p99_s": histogram_quantile(0.99, buckets),
        "engine_queue_share": dq / dt if dt > 0 else None,
    }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request (ok or not). Times in seconds on the driver's clock."""

    session_id: str | None
    replica: str | None
    t_start: float
    ttft_s: float
    e2e_s: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    ideal_cached_tokens: int
    ok: bool = True
    break_reason: str | None = None
    pooled_cached_tokens: int | None = None  # what one shared LRU of the fleet's KV would have hit
    route_reason: str | None = None  # the router's decision (kvroute's X-Kvroute-Reason)
    floor_ttft_s: float | None = None  # its TTFT alone on an idle replica with the pooled cache's hit


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy ``method="linear"``); ``q`` in [0, 100]."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    frac = pos - lo
    return float(s[lo] + (s[hi] - s[lo]) * frac)


class MeasureCollector:
    """Accumulates records and samples; ``result()`` returns the measures dict."""

    def __init__(
        self, *, warmup_s: float = 0.0, end_s: float | None = None, replicas: int = 0, lanes: int | None = None
    ) -> None:
        self.warmup_s = warmup_s
        self.end_s = end_s
        self.replicas = replicas
        self.lanes = lanes
        self._lanes_spent = 0
        self._records: list[RequestRecord] = []
        self._load_count: Counter[int] = Counter()  # pooled per-replica in-flight values
        self._by_replica: dict[str, list[int]] = {}  # replica -> [samples, sum of loads]
        self._samples = 0
        self._replica_slots = 0
        self._moved = 0
        self._moved_by_scaleup = 0
        self._overhead_ms: list[float] = []
        self._engine_queue: dict[str, float | None] = engine_queue_measures(None, None)

    def set_engine_queue(self, before: EngineQueue | None, after: EngineQueue | None) -> None:
        """The engines' own queue and TTFT totals at the start and the end of the measured window."""
        self._engine_queue = engine_queue_measures(before, after)

    def _in_window(self, t: float) -> bool:
        return t >= self.warmup_s and (self.end_s is None or t < self.end_s)

    def add(self, record: RequestRecord) -> None:
        if self._in_window(record.t_start):
            self._records.append(record)

    def sample(self, t: float, loads: Sequence[int], ids: Sequence[str] | None = None) -> None:
        """Per-replica in-flight at time ``t`` (one value per replica present at ``t``); ``ids`` name
        the replicas (default: their positions, for a fleet that does not change)."""
        if not self._in_window(t):
            return
        self._samples += 1
        self._replica_slots += len(loads)
        self._load_count.update(loads)
        for i, v in enumerate(loads):
            acc = self._by_replica.setdefault(ids[i] if ids is not None else str(i), [0, 0])
            acc[0] += 1
            acc[1] += v

    def session_moved(self, t: float, *, by_scaleup: bool = False) -> None:
        """A session that already had a home got a different one at time ``t``."""
        if not self._in_window(t):
            return
        self._moved += 1
        if by_scaleup:
            self._moved_by_scaleup += 1

    def lane_spent(self, t: float) -> None:
        """A lane ran out of sessions at time ``t`` (its last session's main chain ended)."""
        if self.end_s is None or t < self.end_s:
            self._lanes_spent += 1

    def add_gateway_overhead(self, ms: float) -> None:
        self._overhead_ms.append(ms)

    @property
    def records(self) -> tuple[RequestRecord, ...]:
        return tuple(self._records)

    def load_histogram(self) -> dict[int, int]:
        """Pooled per-replica in-flight values -> count (for plots)."""
        return dict(sorted(self._load_count.items()))

    def result(self) -> dict[str, Any]:
        ok = [r for r in self._records if r.ok]
        sum_in = sum(r.input_tokens for r in ok)
        sum_cached = sum(r.cached_tokens for r in ok)
        sum_ideal = sum(r.ideal_cached_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok]
        e2es = [r.e2e_s for r in ok]
        tps = [
            r.output_tokens / (r.e2e_s - r.ttft_s)
            for r in ok
            if r.output_tokens > 1 and r.e2e_s > r.ttft_s
        ]
        n = sum(self._load_count.values())
        dispersion: float | None = None
        p_le1: float | None = None
        p_ge12: float | None = None
        if n:
            mean = sum(v * c for v, c in self._load_count.items()) / n
            var = sum(c * (v - mean) ** 2 for v, c in self._load_count.items()) / n
            dispersion = var / mean if mean > 0 else None
            p_le1 = sum(c for v, c in self._load_count.items() if v <= 1) / n
            p_ge12 = sum(c for v, c in self._load_count.items() if v >= 12) / n
        end = self.end_s
        if end is None and self._records:
            end = max(r.t_start + r.e2e_s for r in self._records)
        window = (end - self.warmup_s) if end is not None else 0.0
        spans = self._session_spans(end) if end is not None and end > self.warmup_s else None
        replicas = self._replica_slots / self._samples if self._samples else float(self.replicas)
        throughput: float | None = None
        if window > 0 and replicas > 0:
            throughput = sum(r.input_tokens + r.output_tokens for r in ok) / window / replicas
        breaks = Counter(r.break_reason for r in self._records if r.break_reason)
        lost: Counter[str] = Counter()
        lost_by_route: Counter[str] = Counter()
        beyond_pool: Counter[str] = Counter()  # pooled cached - cached, per route reason
        routed = False
        for r in ok:
            route = r.route_reason or "none"
            routed = routed or r.route_reason is not None
            beyond_pool[route] += (r.pooled_cached_tokens or 0) - r.cached_tokens
            if r.ideal_cached_tokens > r.cached_tokens:
                lost[r.break_reason or "none"] += r.ideal_cached_tokens - r.cached_tokens
                lost_by_route[route] += r.ideal_cached_tokens - r.cached_tokens
        chr_ = sum_cached / sum_in if sum_in else None
        pooled: float | None = None
        if sum_in and all(r.pooled_cached_tokens is not None for r in ok):
            pooled = sum(r.pooled_cached_tokens or 0 for r in ok) / sum_in
        return {
            "chr": chr_,
            "ideal_chr": sum_ideal / sum_in if sum_in else None,
            "dispersion": dispersion,
            "p_load_le1": p_le1,
            "p_load_ge12": p_ge12,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_floor_p99_s": percentile([r.floor_ttft_s for r in ok if r.floor_ttft_s is not None], 99),
            "e2e_p99_s": percentile(e2es, 99),
            "tps_user_p50": percentile(tps, 50),
            "throughput_tok_s_per_replica": throughput,
            "affinity_breaks": dict(sorted(breaks.items())),
            "cold_prefill_tokens": sum(lost.values()),
            "cold_prefill_by_cause": dict(sorted(lost.items())),
            "cold_prefill_by_route": dict(sorted(lost_by_route.items())) if routed else {},
            "sessions_moved": self._moved,
            "sessions_moved_by_scaleup": self._moved_by_scaleup,
            "gateway_overhead_p50_ms": percentile(self._overhead_ms, 50),
            "gateway_overhead_p99_ms": percentile(self._overhead_ms, 99),
            "requests": len(self._records),
            "errors": len(self._records) - len(ok),
            "dispersion_floor": None if spans is None else self._dispersion_floor(spans, window),
            "dispersion_sticky": None if spans is None else self._dispersion_sticky(spans, window),
            "dispersion_between": self._dispersion_between(),
            "pooled_chr": pooled,
            "routing_loss": None if pooled is None or chr_ is None else pooled - chr_,
            "routing_loss_by_route": (
                {k: v / sum_in for k, v in sorted(beyond_pool.items())} if routed and pooled is not None else {}
            ),
            **self._engine_queue,
            "lanes_spent": None if self.lanes is None else self._lanes_spent,
        }

    def _dispersion_between(self) -> float | None:
        """Σ_r n_r (m_r - m)² / N / m (see the module docstring)."""
        n = sum(c for c, _ in self._by_replica.values())
        if not n:
            return None
        mean = sum(s for _, s in self._by_replica.values()) / n
        if mean <= 0:
            return None
        return sum(c * (s / c - mean) ** 2 for c, s in self._by_replica.values()) / n / mean

    def _session_spans(self, end: float) -> dict[str, list[tuple[float, float]]]:
        """Each session's request spans ``[t_start, t_start + e2e_s]`` clipped to the window."""
        spans: dict[str, list[tuple[float, float]]] = {}
        for r in self._records:
            if r.session_id is None or not math.isfinite(r.e2e_s):
                continue
            lo, hi = max(r.t_start, self.warmup_s), min(r.t_start + r.e2e_s, end)
            if hi > lo:
                spans.setdefault(r.session_id, []).append((lo, hi))
        return spans

    def _dispersion_floor(self, spans: dict[str, list[tuple[float, float]]], window: float) -> float | None:
        """1 - Σf²/Σf over sessions (see the module docstring)."""
        fs: list[float] = []
        for iv in spans.values():
            iv.sort()
            busy = 0.0
            cur_lo, cur_hi = iv[0]
            for lo, hi in iv[1:]:
                if lo > cur_hi:
                    busy += cur_hi - cur_lo
                    cur_lo, cur_hi = lo, hi
                else:
                    cur_hi = max(cur_hi, hi)
            busy += cur_hi - cur_lo
            fs.append(busy / window)
        total = sum(fs)
        return 1.0 - sum(f * f for f in fs) / total if total > 0 else None

    def _dispersion_sticky(self, spans: dict[str, list[tuple[float, float]]], window: float) -> float | None:
        """Σ Var(X_s) / Σ E[X_s], X_s = the session's requests in flight (see the module docstring)."""
        sum_var = sum_mean = 0.0
        for iv in spans.values():
            steps = sorted([(lo, 1) for lo, _ in iv] + [(hi, -1) for _, hi in iv])
            level, t_prev, first, second = 0, steps[0][0], 0.0, 0.0
            for t, step in steps:
                first += level * (t - t_prev)
                second += level * level * (t - t_prev)
                level, t_prev = level + step, t
            mean = first / window
            sum_mean += mean
            sum_var += second / window - mean * mean
        return sum_var / sum_mean if sum_mean > 0 else None

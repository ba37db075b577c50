"""Rolling-window routing statistics for ``/admin/stats`` and the dashboard.

Rules:
  1. No I/O and no clock reads: every method takes ``now`` (seconds on the store's clock), so the
     simulator and tests can drive it with virtual time.
  2. Memory is bounded: events are aggregated into ``bucket_s`` buckets and buckets older than
     ``window_s`` are dropped; the time series keeps at most ``max_points`` samples.
  3. Dispersion is variance / mean of per-replica in-flight requests (as ``loadtests/measures.py`` defines it). "Now" uses the
     latest sample; "window" pools every per-replica value of every sample in the window.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FleetStats", "RollingStats", "SeriesPoint", "dispersion"]


def dispersion(loads: Iterable[float]) -> float:
    """Variance / mean of ``loads`` (population variance); 0.0 for an empty or all-zero fleet."""
    xs = list(loads)
    if not xs:
        return 0.0
    mean = sum(xs) / len(xs)
    if mean <= 0:
        return 0.0
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return var / mean


@dataclass(slots=True)
class _Bucket:
    start: float
    decisions: Counter[str] = field(default_factory=Counter)
    breaks: Counter[str] = field(default_factory=Counter)
    breaks_by_replica: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    input_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    retries: int = 0
    # pooled dispersion accumulators over samples taken in this bucket
    n: int = 0
    s1: float = 0.0
    s2: float = 0.0


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    t: float
    dispersion: float
    chr: float | None  # cache hit rate of requests finished since the previous point; None if none
    in_flight: tuple[int, ...]  # per active replica, sorted by replica id
    requests: int


@dataclass(frozen=True, slots=True)
class FleetStats:
    now: float
    window_s: float
    dispersion_now: float
    dispersion_window: float
    chr_window: float | None
    chr_total: float | None
    requests_window: int
    requests_total: int
    retries_total: int
    decisions_window: dict[str, int]
    decisions_total: dict[str, int]
    breaks_window: dict[str, int]
    breaks_total: dict[str, int]
    breaks_by_replica_total: dict[str, int]
    residency_outcomes_window: dict[str, int]
    residency_outcomes_total: dict[str, int]
    statuses_total: dict[str, int]
    series: tuple[SeriesPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "dispersion_now": round(self.dispersion_now, 6),
            "dispersion_window": round(self.dispersion_window, 6),
            "chr_window": None if self.chr_window is None else round(self.chr_window, 6),
            "chr_total": None if self.chr_total is None else round(self.chr_total, 6),
            "requests_window": self.requests_window,
            "requests_total": self.requests_total,
            "retries_total": self.retries_total,
            "decisions_by_reason": {"window": self.decisions_window, "total": self.decisions_total},
            "affinity_breaks_by_reason": {"window": self.breaks_window, "total": self.breaks_total},
            "residency_outcomes": {"window": self.residency_outcomes_window, "total": self.residency_outcomes_total},
            "requests_by_status": self.statuses_total,
            "series": [
                {
                    "t": round(p.t, 3),
                    "dispersion": round(p.dispersion, 6),
                    "chr": None if p.chr is None else round(p.chr, 6),
                    "in_flight": list(p.in_flight),
                    "requests": p.requests,
                }
                for p in self.series
            ],
        }


class RollingStats:
    """Aggregates routing events over a sliding window (see the module rules)."""

    def __init__(self, window_s: float = 300.0, bucket_s: float = 1.0, max_points: int = 600) -> None:
        if window_s <= 0 or bucket_s <= 0 or max_points <= 0:
            raise ValueError("window_s, bucket_s and max_points must be positive")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque()
        self._series: deque[SeriesPoint] = deque(maxlen=max_points)
        self._decisions: Counter[str] = Counter()
        self._breaks: Counter[str] = Counter()
        self._breaks_by_replica: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        self._statuses: Counter[str] = Counter()
        self._input = 0
        self._cached = 0
        self._requests = 0
        self._retries = 0
        self._last_loads: tuple[int, ...] = ()
        # CHR since the previous series point
        self._pt_input = 0
        self._pt_cached = 0
        self._pt_requests = 0

    # ---- feeding -----------------------------------------------------------------------------

    def _bucket(self, now: float) -> _Bucket:
        start = now - (now % self.bucket_s)
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start=start))
        self._prune(now)
        # events stamped slightly in the past still land in the newest bucket (monotone enough)
        return self._buckets[-1]

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._buckets and self._buckets[0].start + self.bucket_s <= horizon:
            self._buckets.popleft()

    def record_decision(self, now: float, reason: str) -> None:
        self._bucket(now).decisions[reason] += 1
        self._decisions[reason] += 1

    def record_retry(self, now: float) -> None:
        self._bucket(now).retries += 1
        self._retries += 1

    def record_finished(
        self,
        now: float,
        *,
        status: str,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        """A request ended. Only responses that reported both token counts enter the CHR."""
        b = self._bucket(now)
        b.requests += 1
        b.statuses[status] += 1
        self._requests += 1
        self._pt_requests += 1
        self._statuses[status] += 1
        if prompt_tokens is not None and cached_tokens is not None and prompt_tokens > 0:
            cached = max(0, min(cached_tokens, prompt_tokens))
            b.input_tokens += prompt_tokens
            b.cached_tokens += cached
            self._input += prompt_tokens
            self._cached += cached
            self._pt_input += prompt_tokens
            self._pt_cached += cached

    def record_break(self, now: float, reason: str, replica_id: str | None = None) -> None:
        b = self._bucket(now)
        b.breaks[reason] += 1
        self._breaks[reason] += 1
        if replica_id is not None:
            b.breaks_by_replica[replica_id] += 1
            self._breaks_by_replica[replica_id] += 1

    def record_residency_outcome(self, now: float, residency: str, found: bool) -> None:
        """A turn sent home for its cache met what its residency promised (``found``) or not;
        counted as ``<residency>_found`` / ``<residency>_missed``."""
        key = f"{residency}_{'found' if found else 'missed'}"
        self._bucket(now).outcomes[key] += 1
        self._outcomes[key] += 1

    def sample(self, now: float, loads: Sequence[int]) -> SeriesPoint:
        """Record one fixed-interval sample of per-replica in-flight (ACTIVE replicas, by id)."""
        b = self._bucket(now)
        for x in loads:
            b.n += 1
            b.s1 += x
            b.s2 += x * x
        self._last_loads = tuple(loads)
        chr_ = self._pt_cached / self._pt_input if self._pt_input else None
        point = SeriesPoint(
            t=now, dispersion=dispersion(loads), chr=chr_, in_flight=tuple(loads), requests=self._pt_requests
        )
        self._pt_input = self._pt_cached = self._pt_requests = 0
        self._series.append(point)
        return point

    # ---- reading -----------------------------------------------------------------------------

    def breaks_for(self, replica_id: str) -> int:
        return self._breaks_by_replica.get(replica_id, 0)

    def view(self, now: float, loads_now: Sequence[int] | None = None) -> FleetStats:
        """The fleet picture at ``now``; ``loads_now`` (exact, from the store) overrides the last sample."""
        self._prune(now)
        decisions: Counter[str] = Counter()
        breaks: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        inp = cached = reqs = 0
        n = 0
        s1 = s2 = 0.0
        for b in self._buckets:
            decisions.update(b.decisions)
            breaks.update(b.breaks)
            outcomes.update(b.outcomes)
            inp += b.input_tokens
            cached += b.cached_tokens
            reqs += b.requests
            n += b.n
            s1 += b.s1
            s2 += b.s2
        mean = s1 / n if n else 0.0
        disp_w = ((s2 / n - mean * mean) / mean) if n and mean > 0 else 0.0
        horizon = now - self.window_s
        return FleetStats(
            now=now,
            window_s=self.window_s,
            dispersion_now=dispersion(self._last_loads if loads_now is None else loads_now),
            dispersion_window=max(0.0, disp_w),
            chr_window=cached / inp if inp else None,
            chr_total=self._cached / self._input if self._input else None,
            requests_window=reqs,
            requests_total=self._requests,
            retries_total=self._retries,
            decisions_window=dict(sorted(decisions.items())),
            decisions_total=dict(sorted(self._decisions.items())),
            breaks_window=dict(sorted(breaks.items())),
            breaks_total=dict(sorted(self._breaks.items())),
            breaks_by_replica_total=dict(sorted(self._breaks_by_replica.items())),
            residency_outcomes_window=dict(sorted(outcomes.items())),
            residency_outcomes_total=dict(sorted(self._outcomes.items())),
            statuses_total=dict(sorted(self._statuses.items())),
            series=tuple(p for p in self._series if p.t >= horizon),
        )

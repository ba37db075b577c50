"""The autoscaling signal ``kvroute_desired_replicas``: PURE (no clock, no I/O, no globals).

Little's law: the number of requests in the system is L = lambda * W. The gateways count L exactly
(in-flight requests summed over gateways), so the replicas needed to serve it at a target
concurrency per replica are ``ceil(L / target_in_flight_per_replica)``. L is noisy (coding-agent
sessions are bursty: back-to-back tool calls then long think times), so it is smoothed with a
time-based EWMA before it is divided.

A second bound follows from the KV working set (docs/POLICY.md, rule 3): replicas hold only a few coding
sessions' context, so a fleet whose recently active sessions need more KV than
``replicas * capacity * target_kv_fill`` thrashes whatever its request concurrency. The desired
count is the larger of the two.

Scale-down is stabilised like Kubernetes' HPA: the signal reports the *largest* raw value seen in
the last ``scale_down_stabilization_s``, so a quiet minute does not throw away warm caches that
the next burst needs; scale-up is reported at once.

Export (the metrics hook does it): a gauge ``kvroute_desired_replicas``. For an HPA on an external
metric use ``target: {type: AverageValue, averageValue: "1"}`` so desired replicas = the gauge; KEDA's
prometheus scaler likewise with ``threshold: "1"``.

Usage::

    state = AutoscaleState()
    state = observe(state, AutoscaleSample(now, in_flight, active_context_tokens), cfg)
    n = desired_replicas(state, cfg)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = [
    "AutoscaleConfig",
    "AutoscaleSample",
    "AutoscaleState",
    "desired_replicas",
    "littles_law_in_flight",
    "observe",
    "raw_desired",
]


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    target_in_flight_per_replica: float = 4.0  # concurrency one replica serves at the target latency
    smoothing_half_life_s: float = 30.0  # EWMA half-life of in-flight and KV working set
    scale_down_stabilization_s: float = 300.0  # report the max raw desired over this window
    min_replicas: int = 1
    max_replicas: int = 1000
    capacity_tokens_per_replica: int = 0  # HBM (+ host tier) KV tokens of one replica; 0 = ignore KV
    target_kv_fill: float = 0.8  # fraction of capacity the active working set may fill

    def __post_init__(self) -> None:
        if not self.target_in_flight_per_replica > 0:
            raise ValueError("target_in_flight_per_replica must be > 0")
        if not self.smoothing_half_life_s >= 0:
            raise ValueError("smoothing_half_life_s must be >= 0")
        if not self.scale_down_stabilization_s >= 0:
            raise ValueError("scale_down_stabilization_s must be >= 0")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.capacity_tokens_per_replica < 0:
            raise ValueError("capacity_tokens_per_replica must be >= 0")
        if not 0 < self.target_kv_fill <= 1:
            raise ValueError("target_kv_fill must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class AutoscaleSample:
    """One observation of the fleet (gateway clock seconds)."""

    now: float
    in_flight: int  # requests in flight through all gateways
    active_context_tokens: int = 0  # context tokens of recently active sessions, fleet-wide


@dataclass(frozen=True, slots=True)
class AutoscaleState:
    smoothed_in_flight: float = 0.0
    smoothed_context_tokens: float = 0.0
    updated_at: float | None = None  # None = no sample yet
    recent: tuple[tuple[float, int], ...] = ()  # (time, raw desired) within the stabilisation window


def littles_law_in_flight(arrival_rate_per_s: float, mean_latency_s: float) -> float:
    """L = lambda * W: mean requests in flight for a given arrival rate and mean time in system."""
    if arrival_rate_per_s < 0 or mean_latency_s < 0:
        raise ValueError("arrival rate and latency must be >= 0")
    return arrival_rate_per_s * mean_latency_s


def _alpha(dt: float, half_life_s: float) -> float:
    """EWMA weight of a new sample after ``dt`` seconds (1 = take the sample as is)."""
    if half_life_s == 0 or dt == math.inf:
        return 1.0
    if dt <= 0:
        return 0.0
    return 1.0 - math.pow(0.5, dt / half_life_s)


def raw_desired(in_flight: float, context_tokens: float, cfg: AutoscaleConfig) -> int:
    """Replicas needed for the given (smoothed) load, before stabilisation and clamping."""
    by_load = math.ceil(in_flight / cfg.target_in_flight_per_replica - 1e-9)
    by_kv = 0
    if cfg.capacity_tokens_per_replica > 0:
        by_kv = math.ceil(context_tokens / (cfg.capacity_tokens_per_replica * cfg.target_kv_fill) - 1e-9)
    return max(by_load, by_kv, 0)


def observe(state: AutoscaleState, sample: AutoscaleSample, cfg: AutoscaleConfig) -> AutoscaleState:
    """Fold one sample into the state. Samples must come in time order (older ones are ignored)."""
    if sample.in_flight < 0 or sample.active_context_tokens < 0:
        raise ValueError("in_flight and active_context_tokens must be >= 0")
    if state.updated_at is None:
        smoothed_l = float(sample.in_flight)
        smoothed_c = float(sample.active_context_tokens)
    else:
        if sample.now < state.updated_at:
            return state
        a = _alpha(sample.now - state.updated_at, cfg.smoothing_half_life_s)
        smoothed_l = state.smoothed_in_flight + a * (sample.in_flight - state.smoothed_in_flight)
        smoothed_c = state.smoothed_context_tokens + a * (
            sample.active_context_tokens - state.smoothed_context_tokens
        )
    raw = raw_desired(smoothed_l, smoothed_c, cfg)
    horizon = sample.now - cfg.scale_down_stabilization_s
    recent = tuple((t, n) for t, n in state.recent if t >= horizon) + ((sample.now, raw),)
    # Keep the window small: a value dominated by a later, larger-or-equal one can never be the max.
    pruned: list[tuple[float, int]] = []
    for t, n in recent:
        while pruned and pruned[-1][1] <= n:
            pruned.pop()
        pruned.append((t, n))
    return replace(
        state,
        smoothed_in_flight=smoothed_l,
        smoothed_context_tokens=smoothed_c,
        updated_at=sample.now,
        recent=tuple(pruned),
    )


def desired_replicas(state: AutoscaleState, cfg: AutoscaleConfig) -> int:
    """The gauge value: max raw desired over the stabilisation window, clamped to [min, max]."""
    peak = max((n for _, n in state.recent), default=0)
    return min(max(peak, cfg.min_replicas), cfg.max_replicas)

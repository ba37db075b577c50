"""router.autoscale: the pure kvroute_desired_replicas signal."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.autoscale import (
    AutoscaleConfig,
    AutoscaleSample,
    AutoscaleState,
    desired_replicas,
    littles_law_in_flight,
    observe,
    raw_desired,
)


def run(samples: list[tuple[float, int]], cfg: AutoscaleConfig, ctx: int = 0) -> AutoscaleState:
    s = AutoscaleState()
    for t, n in samples:
        s = observe(s, AutoscaleSample(t, n, ctx), cfg)
    return s


def test_littles_law() -> None:
    assert littles_law_in_flight(20.0, 1.5) == 30.0
    with pytest.raises(ValueError):
        littles_law_in_flight(-1.0, 1.0)


@pytest.mark.parametrize(
    ("in_flight", "ctx", "cap", "expected"),
    [
        (0, 0, 0, 0),
        (1, 0, 0, 1),
        (4, 0, 0, 1),  # exactly the target per replica
        (4.0000000001, 0, 0, 1),  # float noise does not add a replica
        (5, 0, 0, 2),
        (32, 0, 0, 8),
        (33, 0, 0, 9),
        # KV working set dominates: 10 M tokens of active context, 0.85 M per replica at 80 % fill
        (8, 10_000_000, 850_000, math.ceil(10_000_000 / (850_000 * 0.8))),
        # load dominates
        (80, 1_000_000, 850_000, 20),
    ],
)
def test_raw_desired(in_flight: float, ctx: int, cap: int, expected: int) -> None:
    cfg = AutoscaleConfig(target_in_flight_per_replica=4.0, capacity_tokens_per_replica=cap)
    assert raw_desired(in_flight, ctx, cfg) == expected


def test_first_sample_is_taken_as_is() -> None:
    cfg = AutoscaleConfig(target_in_flight_per_replica=4)
    s = run([(0.0, 40)], cfg)
    assert s.smoothed_in_flight == 40
    assert desired_replicas(s, cfg) == 10


def test_ewma_half_life() -> None:
    cfg = AutoscaleConfig(smoothing_half_life_s=10.0, scale_down_stabilization_s=0.0)
    s = run([(0.0, 0), (10.0, 100)], cfg)
    assert s.smoothed_in_flight == pytest.approx(50.0)  # one half-life: halfway
    s = observe(s, AutoscaleSample(20.0, 100), cfg)
    assert s.smoothed_in_flight == pytest.approx(75.0)


def test_a_spike_is_smoothed() -> None:
    cfg = AutoscaleConfig(
        target_in_flight_per_replica=4, smoothing_half_life_s=30.0, scale_down_stabilization_s=0
    )
    samples = [(float(t), 16) for t in range(120)]
    samples.append((120.0, 400))  # one second of 400 in flight
    s = run(samples, cfg)
    # 16 -> raw 4; the spike moves the average by ~2.3 % of 384 only
    assert desired_replicas(s, cfg) == math.ceil((16 + (1 - 0.5 ** (1 / 30)) * 384) / 4)
    assert desired_replicas(s, cfg) < 10


def test_scale_up_is_immediate_scale_down_is_stabilised() -> None:
    cfg = AutoscaleConfig(
        target_in_flight_per_replica=4, smoothing_half_life_s=0.0, scale_down_stabilization_s=300.0
    )
    s = run([(0.0, 40)], cfg)
    assert desired_replicas(s, cfg) == 10
    s = observe(s, AutoscaleSample(10.0, 80), cfg)
    assert desired_replicas(s, cfg) == 20  # up at once
    s = observe(s, AutoscaleSample(20.0, 8), cfg)
    assert desired_replicas(s, cfg) == 20  # down held
    s = observe(s, AutoscaleSample(309.0, 8), cfg)
    assert desired_replicas(s, cfg) == 20  # the 80 at t=10 is still inside the window
    s = observe(s, AutoscaleSample(311.0, 8), cfg)
    assert desired_replicas(s, cfg) == 2  # window passed


def test_clamped_to_min_and_max() -> None:
    cfg = AutoscaleConfig(
        min_replicas=2, max_replicas=5, smoothing_half_life_s=0, scale_down_stabilization_s=0
    )
    assert desired_replicas(run([(0.0, 0)], cfg), cfg) == 2
    assert desired_replicas(run([(0.0, 1000)], cfg), cfg) == 5
    assert desired_replicas(AutoscaleState(), cfg) == 2


def test_out_of_order_samples_are_ignored() -> None:
    cfg = AutoscaleConfig()
    s = run([(10.0, 40)], cfg)
    assert observe(s, AutoscaleSample(5.0, 0), cfg) == s


@pytest.mark.parametrize(
    "kw",
    [
        {"target_in_flight_per_replica": 0},
        {"smoothing_half_life_s": -1},
        {"scale_down_stabilization_s": -1},
        {"min_replicas": 3, "max_replicas": 2},
        {"capacity_tokens_per_replica": -1},
        {"target_kv_fill": 0},
        {"target_kv_fill": 1.5},
    ],
)
def test_config_validation(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AutoscaleConfig(**kw)  # type: ignore[arg-type]


def test_negative_sample_rejected() -> None:
    with pytest.raises(ValueError):
        observe(AutoscaleState(), AutoscaleSample(0.0, -1), AutoscaleConfig())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.integers(0, 500)), min_size=1, max_size=60),
    st.floats(0, 120, allow_nan=False),
    st.floats(0, 600, allow_nan=False),
)
def test_properties(steps: list[tuple[float, int]], half_life: float, window: float) -> None:
    cfg = AutoscaleConfig(
        target_in_flight_per_replica=4,
        smoothing_half_life_s=half_life,
        scale_down_stabilization_s=window,
        min_replicas=1,
        max_replicas=200,
    )
    s = AutoscaleState()
    t = 0.0
    lo = min(n for _, n in steps)
    hi = max(n for _, n in steps)
    for dt, n in steps:
        t += dt
        prev = desired_replicas(s, cfg)
        s = observe(s, AutoscaleSample(t, n), cfg)
        # the smoothed load stays inside the range of what was observed
        assert lo - 1e-6 <= s.smoothed_in_flight <= hi + 1e-6
        d = desired_replicas(s, cfg)
        assert cfg.min_replicas <= d <= cfg.max_replicas
        # it never reports less than what the current smoothed load needs
        assert d >= min(raw_desired(s.smoothed_in_flight, 0, cfg), cfg.max_replicas)
        # within the stabilisation window it never goes down
        if window >= t:
            assert d >= prev
        # the window stays small (a monotone decreasing stack)
        ns = [n for _, n in s.recent]
        assert ns == sorted(ns, reverse=True) and len(set(ns)) == len(ns)

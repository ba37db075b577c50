from __future__ import annotations

import pytest

from loadtests.measures import (
    MEASURE_FIELDS,
    EngineQueue,
    MeasureCollector,
    RequestRecord,
    engine_queue_measures,
    histogram_quantile,
    percentile,
)


def rec(t: float, ttft: float, e2e: float, inp: int, cached: int, out: int, ideal: int, **kw: object) -> RequestRecord:
    return RequestRecord("s", "r0", t, ttft, e2e, inp, cached, out, ideal, **kw)  # type: ignore[arg-type]


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_result_fields_exact() -> None:
    m = MeasureCollector(warmup_s=10.0, end_s=110.0)
    m.add(rec(5.0, 9.0, 9.0, 1000, 0, 10, 0))  # warm-up: ignored
    m.add(rec(10.0, 0.5, 2.5, 1000, 900, 11, 950))
    m.add(rec(20.0, 1.5, 3.5, 3000, 1000, 21, 2900, break_reason="evicted"))
    m.add(rec(30.0, 0.0, 0.1, 500, 0, 0, 0, ok=False, break_reason="replica_gone"))
    m.sample(5.0, [100, 100])  # warm-up: ignored
    m.sample(10.0, [0, 2, 4])
    m.sample(20.0, [1, 12, 5])
    m.session_moved(5.0, by_scaleup=True)  # warm-up
    m.session_moved(50.0)
    m.session_moved(60.0, by_scaleup=True)
    m.sample(110.0, [50])  # end_s is exclusive
    r = m.result()
    assert set(r) == set(MEASURE_FIELDS)
    assert r["chr"] == pytest.approx(1900 / 4000)
    assert r["ideal_chr"] == pytest.approx(3850 / 4000)
    vals = [0, 2, 4, 1, 12, 5]
    mean = sum(vals) / 6
    var = sum((v - mean) ** 2 for v in vals) / 6
    assert r["dispersion"] == pytest.approx(var / mean)
    assert r["p_load_le1"] == pytest.approx(2 / 6)
    assert r["p_load_ge12"] == pytest.approx(1 / 6)
    assert r["ttft_p50_s"] == pytest.approx(1.0)
    assert r["ttft_p99_s"] == pytest.approx(0.5 + 0.99)
    assert r["e2e_p99_s"] == pytest.approx(2.5 + 0.99)
    assert r["tps_user_p50"] == pytest.approx((11 / 2 + 21 / 2) / 2)
    assert r["throughput_tok_s_per_replica"] == pytest.approx((1011 + 3021) / 100.0 / 3)
    assert r["affinity_breaks"] == {"evicted": 1, "replica_gone": 1}
    assert r["cold_prefill_tokens"] == 50 + 1900
    assert r["cold_prefill_by_cause"] == {"evicted": 1900, "none": 50}
    assert r["sessions_moved"] == 2
    assert r["sessions_moved_by_scaleup"] == 1
    assert r["gateway_overhead_p50_ms"] is None and r["gateway_overhead_p99_ms"] is None
    assert r["requests"] == 3 and r["errors"] == 1
    assert m.load_histogram() == {0: 1, 1: 1, 2: 1, 4: 1, 5: 1, 12: 1}


def test_empty_and_overhead() -> None:
    m = MeasureCollector(replicas=4)
    for x in (0.1, 0.2, 0.3, 10.0):
        m.add_gateway_overhead(x)
    r = m.result()
    assert r["chr"] is None and r["dispersion"] is None and r["throughput_tok_s_per_replica"] is None
    assert r["gateway_overhead_p50_ms"] == pytest.approx(0.25)
    assert r["gateway_overhead_p99_ms"] == pytest.approx(0.3 + 9.7 * 0.97)
    assert r["requests"] == 0


def test_uniform_load_has_zero_dispersion_and_throughput_uses_replicas_arg() -> None:
    m = MeasureCollector(replicas=2)
    m.sample(1.0, [3, 3])
    m.sample(2.0, [3, 3])
    m.add(rec(0.0, 0.1, 4.0, 100, 0, 100, 0))
    r = m.result()
    assert r["dispersion"] == 0.0
    assert r["p_load_le1"] == 0.0
    assert r["throughput_tok_s_per_replica"] == pytest.approx(200 / 4.0 / 2)


def _three_sessions() -> MeasureCollector:
    """Window [0, 100): session a busy 10..30 and 20..40 (overlapping), b 50..150, c 0..10."""
    m = MeasureCollector(warmup_s=0.0, end_s=100.0)
    m.add(RequestRecord("a", "r0", 10.0, 1.0, 20.0, 100, 0, 1, 0))
    m.add(RequestRecord("a", "r0", 20.0, 1.0, 20.0, 100, 0, 1, 0))
    m.add(RequestRecord("b", "r1", 50.0, 1.0, 100.0, 100, 0, 1, 0))
    m.add(RequestRecord("c", "r1", 0.0, 1.0, 10.0, 100, 0, 1, 0))
    return m


def test_dispersion_floor_is_the_binomial_floor_of_the_sessions_busy_fractions() -> None:
    # window [0, 100): session a busy 10..30 and 20..40 (union 30 s: f = 0.3), b busy 50..150
    # (clipped to 50 s: f = 0.5), c busy 0..10 (f = 0.1)
    m = _three_sessions()
    fs = [0.3, 0.5, 0.1]
    assert m.result()["dispersion_floor"] == pytest.approx(1 - sum(f * f for f in fs) / sum(fs))


def test_dispersion_sticky_counts_a_sessions_parallel_requests() -> None:
    # a's two requests overlap on [20, 30), so X_a is 1, 2, 1 on
    # [10, 20), [20, 30), [30, 40): E = 0.4, E[X²] = 0.6, Var = 0.44; b and c are Bernoulli
    m = _three_sessions()
    r = m.result()
    assert r["dispersion_sticky"] == pytest.approx((0.44 + 0.25 + 0.09) / (0.4 + 0.5 + 0.1))
    assert r["dispersion_sticky"] > r["dispersion_floor"]


def test_dispersion_sticky_is_the_floor_when_no_session_overlaps_itself() -> None:
    m = MeasureCollector(warmup_s=10.0, end_s=110.0)
    m.add(RequestRecord("a", "r0", 10.0, 1.0, 20.0, 100, 0, 1, 0))
    m.add(RequestRecord("a", "r0", 35.0, 1.0, 5.0, 100, 0, 1, 0))
    m.add(RequestRecord("b", "r1", 60.0, 1.0, 80.0, 100, 0, 1, 0))  # clipped to [60, 110)
    r = m.result()
    assert r["dispersion_sticky"] == pytest.approx(r["dispersion_floor"])
    assert r["dispersion_sticky"] == pytest.approx(1 - (0.25**2 + 0.5**2) / 0.75)
    assert MeasureCollector().result()["dispersion_sticky"] is None


def test_dispersion_floor_of_one_always_busy_session_is_zero_and_none_without_window() -> None:
    m = MeasureCollector(warmup_s=0.0, end_s=10.0)
    m.add(RequestRecord("a", "r0", 0.0, 1.0, 10.0, 100, 0, 1, 0))
    assert m.result()["dispersion_floor"] == pytest.approx(0.0)
    assert MeasureCollector().result()["dispersion_floor"] is None


def test_pooled_chr_and_routing_loss() -> None:
    m = MeasureCollector()
    m.add(rec(0.0, 1.0, 2.0, 1000, 600, 1, 900, pooled_cached_tokens=800))
    m.add(rec(1.0, 1.0, 2.0, 1000, 900, 1, 950, pooled_cached_tokens=900))
    m.add(rec(2.0, 1.0, 2.0, 500, 0, 0, 0, ok=False, pooled_cached_tokens=0))  # not ok: ignored
    r = m.result()
    assert r["pooled_chr"] == pytest.approx(1700 / 2000)
    assert r["routing_loss"] == pytest.approx(1700 / 2000 - 1500 / 2000)


def test_cold_prefill_and_routing_loss_split_by_the_routers_decision() -> None:
    m = MeasureCollector()
    m.add(rec(0.0, 1.0, 2.0, 1000, 600, 1, 900, pooled_cached_tokens=800, route_reason="affinity"))
    m.add(rec(1.0, 1.0, 2.0, 1000, 100, 1, 950, pooled_cached_tokens=900, route_reason="placed_evicted"))
    m.add(rec(2.0, 1.0, 2.0, 1000, 700, 1, 700, pooled_cached_tokens=500, route_reason="affinity"))
    m.add(rec(3.0, 1.0, 2.0, 500, 0, 0, 400, pooled_cached_tokens=300))  # no decision: "none"
    r = m.result()
    assert r["cold_prefill_by_route"] == {"affinity": 300, "none": 400, "placed_evicted": 850}
    by = r["routing_loss_by_route"]
    # affinity: (800 - 600) + (500 - 700) = 0 (one hit more than the pool would); evicted: 800
    assert by == pytest.approx({"affinity": 0.0, "none": 300 / 3500, "placed_evicted": 800 / 3500})
    assert sum(by.values()) == pytest.approx(r["routing_loss"])


def test_ttft_floor_is_the_p99_of_the_records_floors() -> None:
    m = MeasureCollector()
    for i in range(101):
        m.add(rec(float(i), 10.0 + i, 20.0 + i, 1000, 500, 1, 900, floor_ttft_s=float(i)))
    m.add(rec(200.0, 1.0, 2.0, 1000, 0, 0, 0, ok=False, floor_ttft_s=1e9))  # not ok: ignored
    m.add(rec(201.0, 1.0, 2.0, 1000, 0, 1, 0))  # no floor: left out of it
    r = m.result()
    assert r["ttft_floor_p99_s"] == pytest.approx(99.0)
    assert MeasureCollector().result()["ttft_floor_p99_s"] is None


def test_no_split_by_decision_without_decisions() -> None:
    m = MeasureCollector()
    m.add(rec(0.0, 1.0, 2.0, 1000, 600, 1, 900, pooled_cached_tokens=800))
    r = m.result()
    assert r["cold_prefill_by_route"] == {} and r["routing_loss_by_route"] == {}
    assert r["cold_prefill_by_cause"] == {"none": 300}


def test_pooled_chr_is_none_when_a_record_has_no_pooled_figure() -> None:
    m = MeasureCollector()
    m.add(rec(0.0, 1.0, 2.0, 1000, 600, 1, 900, pooled_cached_tokens=800))
    m.add(rec(1.0, 1.0, 2.0, 1000, 900, 1, 950))
    r = m.result()
    assert r["pooled_chr"] is None and r["routing_loss"] is None


def test_dispersion_between_is_the_part_from_unequal_replica_means() -> None:
    # replica a carries 2 then 4 (mean 3), b carries 1 then 1 (mean 1): pooled mean 2, pooled
    # variance (0 + 4 + 1 + 1) / 4 = 1.5, between-replica variance ((3-2)² + (1-2)²) / 2 = 1
    m = MeasureCollector()
    m.sample(1.0, [2, 1], ["a", "b"])
    m.sample(2.0, [1, 4], ["b", "a"])  # order changes: the ids say who is who
    r = m.result()
    assert r["dispersion"] == pytest.approx(1.5 / 2)
    assert r["dispersion_between"] == pytest.approx(1.0 / 2)


def test_dispersion_between_is_zero_for_equal_means_and_none_without_samples() -> None:
    m = MeasureCollector()
    m.sample(1.0, [0, 4])
    m.sample(2.0, [4, 0])
    r = m.result()
    assert r["dispersion"] == pytest.approx(2.0) and r["dispersion_between"] == pytest.approx(0.0)
    assert MeasureCollector().result()["dispersion_between"] is None


def test_histogram_quantile_as_prometheus() -> None:
    inf = float("inf")
    b = ((0.5, 2.0), (1.0, 6.0), (2.0, 10.0), (inf, 10.0))
    assert histogram_quantile(0.5, b) == pytest.approx(0.875)  # rank 5 in (0.5, 1]: 0.5 + 0.5 x 3/4
    assert histogram_quantile(0.99, b) == pytest.approx(1.975)
    assert histogram_quantile(0.1, b) == pytest.approx(0.25)  # first bucket from 0
    assert histogram_quantile(0.99, ((1.0, 1.0), (inf, 100.0))) == 1.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, ((0.0, 4.0), (1.0, 4.0), (inf, 4.0))) == 0.0  # all zero waits
    assert histogram_quantile(0.5, ((1.0, 0.0), (inf, 0.0))) is None
    assert histogram_quantile(0.5, ()) is None


def test_engine_queue_measures_difference_two_readings() -> None:
    inf = float("inf")
    before = EngineQueue(((1.0, 3.0), (10.0, 4.0), (inf, 4.0)), queue_sum=5.0, queue_count=4.0, ttft_sum=9.0, ttft_count=4.0)
    after = EngineQueue(((1.0, 5.0), (10.0, 14.0), (inf, 14.0)), queue_sum=65.0, queue_count=14.0, ttft_sum=129.0,
                        ttft_count=14.0)
    m = engine_queue_measures(before, after)
    assert m["engine_queue_mean_s"] == pytest.approx(60.0 / 10.0)
    assert m["engine_queue_share"] == pytest.approx(60.0 / 120.0)
    # Δ buckets (1: 2, 10: 10): rank 9.9 in (1, 10]: 1 + 9 x 7.9 / 8
    assert m["engine_queue_p99_s"] == pytest.approx(1.0 + 9.0 * 7.9 / 8.0)
    assert engine_queue_measures(None, after)["engine_queue_mean_s"] == pytest.approx(65.0 / 14.0)
    assert engine_queue_measures(after, after) == engine_queue_measures(None, None)  # nothing in between
    assert set(engine_queue_measures(None, None).values()) == {None}
    c = MeasureCollector()
    c.set_engine_queue(before, after)
    assert c.result()["engine_queue_share"] == pytest.approx(0.5)


def test_lanes_spent_counts_lanes_that_ran_out_before_the_window_ended() -> None:
    m = MeasureCollector(warmup_s=10.0, end_s=100.0, lanes=4)
    m.lane_spent(0.0)  # a lane with no session at all
    m.lane_spent(50.0)
    m.lane_spent(100.0)  # at the end: it sent all it could within the window
    m.lane_spent(150.0)  # after it (drain): not spent in the window
    assert m.result()["lanes_spent"] == 2
    # no lanes: no figure; the figure is a count, 0 when every lane still had sessions
    assert MeasureCollector(end_s=100.0).result()["lanes_spent"] is None
    assert MeasureCollector(end_s=100.0, lanes=3).result()["lanes_spent"] == 0
    # no window end: every report counts
    open_ended = MeasureCollector(lanes=1)
    open_ended.lane_spent(1e9)
    assert open_ended.result()["lanes_spent"] == 1

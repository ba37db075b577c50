"""RollingStats: pure rolling-window fleet statistics behind /admin/stats (virtual time)."""

from __future__ import annotations

import pytest

from router.observability.stats import RollingStats, dispersion


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([], 0.0),
        ([0, 0, 0], 0.0),
        ([2, 2, 2, 2], 0.0),
        ([0, 4], 2.0),  # mean 2, var 4
        ([1, 2, 3], (2 / 3) / 2),
    ],
)
def test_dispersion(loads: list[int], expected: float) -> None:
    assert dispersion(loads) == pytest.approx(expected)


def test_window_chr_decisions_and_breaks_expire() -> None:
    st = RollingStats(window_s=10.0, bucket_s=1.0)
    st.record_decision(0.5, "placed_new")
    st.record_finished(0.6, status="200", prompt_tokens=1000, cached_tokens=0)
    st.record_decision(5.0, "affinity")
    st.record_finished(5.1, status="200", prompt_tokens=1000, cached_tokens=900)
    st.record_break(5.2, "evicted", "r1")
    v = st.view(6.0)
    assert v.chr_window == pytest.approx(0.45)
    assert v.decisions_window == {"affinity": 1, "placed_new": 1}
    assert v.breaks_window == {"evicted": 1}
    # the first second's bucket falls out of the window; totals keep it
    v = st.view(12.0)
    assert v.chr_window == pytest.approx(0.9)
    assert v.decisions_window == {"affinity": 1}
    assert v.decisions_total == {"affinity": 1, "placed_new": 1}
    assert v.chr_total == pytest.approx(0.45)
    assert v.requests_total == 2 and v.requests_window == 1
    assert st.breaks_for("r1") == 1 and st.breaks_for("r2") == 0
    v = st.view(30.0)
    assert v.chr_window is None and v.breaks_window == {} and v.breaks_total == {"evicted": 1}


def test_residency_outcomes_count_by_residency_and_expire_from_the_window() -> None:
    st = RollingStats(window_s=10.0, bucket_s=1.0)
    st.record_residency_outcome(1.0, "events", True)
    st.record_residency_outcome(1.5, "events", False)
    st.record_residency_outcome(8.0, "estimate", True)
    st.record_residency_outcome(8.2, "events", True)
    v = st.view(9.0)
    assert v.residency_outcomes_window == {"estimate_found": 1, "events_found": 2, "events_missed": 1}
    v = st.view(15.0)  # the first two fell out of the window; totals keep them
    assert v.residency_outcomes_window == {"estimate_found": 1, "events_found": 1}
    assert v.residency_outcomes_total == {"estimate_found": 1, "events_found": 2, "events_missed": 1}
    assert v.to_dict()["residency_outcomes"] == {"window": v.residency_outcomes_window,
                                                 "total": v.residency_outcomes_total}  # fmt: skip


def test_unknown_token_counts_stay_out_of_chr() -> None:
    st = RollingStats()
    st.record_finished(1.0, status="200", prompt_tokens=None, cached_tokens=None)
    st.record_finished(1.0, status="502", prompt_tokens=100, cached_tokens=None)
    v = st.view(1.0)
    assert v.chr_total is None and v.requests_total == 2
    assert v.statuses_total == {"200": 1, "502": 1}


def test_pooled_window_dispersion_and_series() -> None:
    st = RollingStats(window_s=5.0, bucket_s=1.0, max_points=3)
    st.sample(0.0, [4, 0])
    st.record_finished(0.5, status="200", prompt_tokens=10, cached_tokens=5)
    st.sample(1.0, [2, 2])
    v = st.view(1.0)
    # pooled over [4, 0, 2, 2]: mean 2, var 2 -> 1.0; now = last sample [2, 2] -> 0
    assert v.dispersion_window == pytest.approx(1.0)
    assert v.dispersion_now == 0.0
    assert v.dispersion_now == st.view(1.0, loads_now=[2, 2]).dispersion_now
    assert st.view(1.0, loads_now=[0, 6]).dispersion_now == pytest.approx(3.0)
    assert [p.chr for p in v.series] == [None, 0.5]
    assert [p.in_flight for p in v.series] == [(4, 0), (2, 2)]
    for t in (2.0, 3.0, 4.0):
        st.sample(t, [1, 1])
    assert len(st.view(4.0).series) == 3  # bounded
    d = st.view(4.0).to_dict()
    assert set(d) >= {"dispersion_now", "dispersion_window", "chr_window", "decisions_by_reason", "series"}


def test_rejects_bad_window() -> None:
    with pytest.raises(ValueError):
        RollingStats(window_s=0)

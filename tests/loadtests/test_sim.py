"""The fleet simulator end to end: real policy code, MemoryCore, emulated engines, virtual time."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from loadtests.sim.run import FailureEvent, ScaleEvent, SimConfig, default_profile, run_sim
from loadtests.workloads import SessionSpec, SyntheticParams, Turn, synthetic_sessions
from router.policy.hashing import hrw_top

# ---- the seed's sketch: uniform hashing, 250 sessions on 50 replicas ---------------------------------


def _long_single_turn_sessions(seed: int, n: int = 250) -> list[SessionSpec]:
    rng = random.Random(seed)
    # one request per session that decodes for far longer than the sampled window
    return [
        SessionSpec(f"seed{seed}-{rng.getrandbits(48):012x}", 0.0, 0, (Turn(1024, 20_000, 0.0),))
        for _ in range(n)
    ]


def _sketch_run(seed: int) -> tuple[Counter[int], list[SessionSpec]]:
    specs = _long_single_turn_sessions(seed)
    cfg = SimConfig(
        replicas=50, policy="hash", duration_s=6.0, warmup_s=1.0, drain_s=0.0, sample_interval_s=5.0, seed=seed
    )
    res = run_sim(specs, cfg)
    assert res.measures["errors"] == 0
    return Counter(res.load_histogram), specs


def test_seed_sketch_uniform_hashing_50_replicas_250_sessions() -> None:
    pooled: Counter[int] = Counter()
    runs = 40
    for seed in range(runs):
        hist, specs = _sketch_run(seed)
        if seed == 0:
            # exact cross-check: in-flight per replica == sessions the rendezvous hash gives it
            want = Counter(hrw_top(s.session_id, [f"r{i:03d}" for i in range(50)]) for s in specs)
            assert hist == Counter(want[f"r{i:03d}"] for i in range(50))
        pooled.update(hist)
    n = sum(pooled.values())
    assert n == 50 * runs
    p_le1 = sum(c for v, c in pooled.items() if v <= 1) / n
    p_ge12 = sum(c for v, c in pooled.items() if v >= 12) / n
    # Binomial(250, 1/50): P(<=1) = 3.9 %, P(>=12) = 0.5 %; bounds are ~3 standard errors
    assert 0.026 <= p_le1 <= 0.053, p_le1
    assert 0.0005 <= p_ge12 <= 0.012, p_ge12
    assert sum(v * c for v, c in pooled.items()) == 250 * runs


# ---- a small fleet where placement matters ----------------------------------------------------------

SMALL = SyntheticParams(
    sessions=160,
    shared_prefix_tokens=4_000,
    task_tokens_median=2_000,
    new_tokens_median=400,
    output_tokens_median=200,
    max_context_tokens=60_000,
    compact_tokens=8_000,
    turns_median=30,
)


_SMALL_CFG = SimConfig(
    replicas=6,
    profile=default_profile(256).with_overrides(kv_capacity_tokens=300_000, host_capacity_tokens=0),
    lanes=60,
    duration_s=150.0,
    warmup_s=40.0,
    start_mid_session=True,
    seed=3,
)


def _small_cfg(policy: str, **kw: Any) -> SimConfig:
    return replace(_SMALL_CFG, policy=policy, **kw)


@pytest.fixture(scope="module")
def small_specs() -> list[SessionSpec]:
    return synthetic_sessions(SMALL, random.Random(5))


@pytest.fixture(scope="module")
def small_runs(small_specs: list[SessionSpec]) -> dict[str, dict[str, object]]:
    return {p: run_sim(small_specs, _small_cfg(p)).measures for p in ("kv_aware", "hash", "least_loaded")}


def test_kv_aware_beats_hash_on_dispersion_and_ttft_and_least_loaded_on_chr(
    small_runs: dict[str, dict[str, object]],
) -> None:
    kv, h, ll = small_runs["kv_aware"], small_runs["hash"], small_runs["least_loaded"]
    for m in (kv, h, ll):
        assert m["requests"] > 1000 and m["errors"] == 0
        assert 0.9 < m["ideal_chr"] <= 1.0  # type: ignore[operator]
        assert m["chr"] <= m["ideal_chr"]  # type: ignore[operator]
    assert kv["dispersion"] < 0.5 * h["dispersion"]  # type: ignore[operator]
    assert kv["ttft_p99_s"] < h["ttft_p99_s"]  # type: ignore[operator]
    assert kv["chr"] >= h["chr"] - 0.01  # type: ignore[operator]
    assert kv["chr"] > ll["chr"] + 0.2  # type: ignore[operator]  # no affinity: cache mostly lost
    assert ll["cold_prefill_tokens"] > 2 * kv["cold_prefill_tokens"]  # type: ignore[operator]
    assert sum(h["affinity_breaks"].values()) > 0  # type: ignore[union-attr]


def test_determinism_for_a_seed(small_specs: list[SessionSpec], small_runs: dict[str, dict[str, object]]) -> None:
    again = run_sim(small_specs, _small_cfg("kv_aware")).measures
    assert again == small_runs["kv_aware"]
    other = run_sim(small_specs, _small_cfg("kv_aware", seed=4)).measures
    assert other != again


def test_scale_up_moves_no_kv_aware_session_but_hash_remaps(small_specs: list[SessionSpec]) -> None:
    ev = (ScaleEvent(80.0, 8),)
    kv = run_sim(small_specs, _small_cfg("kv_aware", replicas=6, scale=ev))
    h = run_sim(small_specs, _small_cfg("hash", replicas=6, scale=ev))
    assert kv.stats["replicas_final"] == 8 and h.stats["replicas_final"] == 8
    assert kv.measures["sessions_moved_by_scaleup"] == 0
    assert h.measures["sessions_moved_by_scaleup"] > 0  # hash remaps the keys the new replicas win
    assert h.measures["sessions_moved"] == h.measures["sessions_moved_by_scaleup"]
    assert h.measures["affinity_breaks"].get("replica_gone", 0) > 0
    # the new replicas got work under kv_aware too (new sessions)
    assert len([r for r in kv.records if r.replica in ("r006", "r007")]) > 0


def test_replica_failure_retries_and_moves_sessions(small_specs: list[SessionSpec]) -> None:
    res = run_sim(small_specs, _small_cfg("kv_aware", failures=(FailureEvent(70.0, 2),)))
    m = res.measures
    assert res.stats["replicas_final"] == 5
    assert m["sessions_moved"] > 0
    assert m["affinity_breaks"].get("replica_gone", 0) > 0
    late = [r for r in res.records if r.t_start > 75.0]
    assert late and all(r.replica != "r002" for r in late)
    # in-flight requests without output were retried elsewhere; streaming ones are errors, bounded
    assert m["errors"] <= 15


def test_gateways_with_state_lag_and_scale_down(small_specs: list[SessionSpec]) -> None:
    one = run_sim(small_specs, _small_cfg("kv_aware")).measures
    four = run_sim(small_specs, _small_cfg("kv_aware", gateways=4, state_lag_s=0.1)).measures
    assert four["errors"] == 0 and four["requests"] > 0.8 * one["requests"]  # type: ignore[operator]
    assert four["dispersion"] < 2.0 * one["dispersion"] + 0.2  # type: ignore[operator]
    down = run_sim(small_specs, _small_cfg("kv_aware", scale=(ScaleEvent(70.0, 4),)))
    assert down.stats["replicas_final"] == 4
    assert down.measures["errors"] == 0
    assert all(r.replica not in ("r004", "r005") for r in down.records if r.t_start > 90.0)

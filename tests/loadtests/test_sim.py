"""The fleet simulator end to end: real policy code, MemoryCore, emulated engines, virtual time."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from loadtests.sim.run import FailureEvent, ScaleEvent, SimConfig, default_profile, run_sim
from loadtests.workloads import SessionSpec, SyntheticParams, Turn, synthetic_sessions
from replica.emulator.profiles import Profile
from router.errors import NoReplicaError
from router.model import ClusterSnapshot, RouteDecision, RouteRequest, fleet_totals
from router.policy import make_policy
from router.policy.hashing import hrw_top
from router.policy.params import PolicyParams

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
    sessions=200,
    shared_prefix_tokens=4_000,
    task_tokens_median=2_000,
    new_tokens_median=400,
    output_tokens_median=200,
    max_context_tokens=60_000,
    compact_tokens=8_000,
    turns_median=30,
)


# 8 replicas with a small KV pool (200k tokens, no host tier) and 6 sessions each on average:
# hashing's unlucky replicas hold more sessions than fit and thrash; balanced placement does not.
_SMALL_CFG = SimConfig(
    replicas=8,
    profile=default_profile(256).with_overrides(kv_capacity_tokens=200_000, host_capacity_tokens=0),
    lanes=48,
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


def test_kv_aware_beats_hash_on_chr_dispersion_ttft_and_least_loaded_on_chr(
    small_runs: dict[str, dict[str, object]],
) -> None:
    kv, h, ll = small_runs["kv_aware"], small_runs["hash"], small_runs["least_loaded"]
    for m in (kv, h, ll):
        assert m["requests"] > 1000 and m["errors"] == 0
        assert 0.9 < m["ideal_chr"] <= 1.0  # type: ignore[operator]
        assert m["chr"] <= m["ideal_chr"]  # type: ignore[operator]
    assert kv["dispersion"] < 0.5 * h["dispersion"]  # type: ignore[operator]
    assert kv["ttft_p99_s"] < h["ttft_p99_s"]  # type: ignore[operator]
    assert kv["chr"] > h["chr"] + 0.02  # type: ignore[operator]
    assert kv["chr"] > ll["chr"] + 0.2  # type: ignore[operator]  # no affinity: cache mostly lost
    assert ll["cold_prefill_tokens"] > 2 * kv["cold_prefill_tokens"]  # type: ignore[operator]
    assert sum(h["affinity_breaks"].values()) > 0  # type: ignore[union-attr]


def test_determinism_for_a_seed(small_specs: list[SessionSpec], small_runs: dict[str, dict[str, object]]) -> None:
    again = run_sim(small_specs, _small_cfg("kv_aware")).measures
    assert again == small_runs["kv_aware"]
    other = run_sim(small_specs, _small_cfg("kv_aware", seed=4)).measures
    assert other != again


def test_scale_up_moves_no_kv_aware_session_but_hash_remaps(small_specs: list[SessionSpec]) -> None:
    ev = (ScaleEvent(80.0, 10),)
    kv = run_sim(small_specs, _small_cfg("kv_aware", scale=ev))
    h = run_sim(small_specs, _small_cfg("hash", scale=ev))
    assert kv.stats["replicas_final"] == 10 and h.stats["replicas_final"] == 10
    assert kv.measures["sessions_moved_by_scaleup"] == 0
    assert h.measures["sessions_moved_by_scaleup"] > 0  # hash remaps the keys the new replicas win
    assert h.measures["sessions_moved"] == h.measures["sessions_moved_by_scaleup"]
    assert h.measures["affinity_breaks"].get("replica_gone", 0) > 0
    # the new replicas got work under kv_aware too (new sessions)
    assert len([r for r in kv.records if r.replica in ("r008", "r009")]) > 0


def test_replica_failure_retries_and_moves_sessions(small_specs: list[SessionSpec]) -> None:
    res = run_sim(small_specs, _small_cfg("kv_aware", failures=(FailureEvent(70.0, 2),)))
    m = res.measures
    assert res.stats["replicas_final"] == 7
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
    down = run_sim(small_specs, _small_cfg("kv_aware", scale=(ScaleEvent(70.0, 6),)))
    assert down.stats["replicas_final"] == 6
    assert down.measures["errors"] == 0
    assert all(r.replica not in ("r006", "r007") for r in down.records if r.t_start > 90.0)


def test_kv_events_give_the_policy_exact_residency(small_specs: list[SessionSpec]) -> None:
    """With ``kv_events`` every replica's cache feeds a residency mirror, as SGLang's KV events feed
    the gateway: decisions on known sessions go by it, and the estimate is checked against it."""
    off = run_sim(small_specs, _small_cfg("kv_aware"))
    on = run_sim(small_specs, _small_cfg("kv_aware", kv_events=True))
    assert off.stats["residency_checks"] == {}
    checks = on.stats["residency_checks"]
    assert checks.get("agree", 0) > 0.5 * sum(checks.values()) > 0
    # the turns each residency sent home, judged by the cache they found there, as the gateway judges
    # them: the estimate alone without events; with them, the events' (a miss is a cache evicted
    # while its turn queued)
    assert set(off.stats["residency_outcomes"]) == {"estimate"}
    ev = on.stats["residency_outcomes"]["events"]
    assert ev["found"] > 0 and ev["missed"] <= 0.1 * ev["found"], ev
    assert on.measures["errors"] == 0 and on.measures["requests"] > 0.9 * off.measures["requests"]
    # exact residency keeps a session home while a tenth of its context is resident (the shared
    # prefix counts), so it promises no fewer `evicted` breaks than the estimate (over eight seeds of
    # this fleet either has more on some); what it must not do is cost hit rate (round 15: ±0.01)
    assert on.measures["chr"] >= off.measures["chr"] - 0.01  # type: ignore[operator]


def test_parallel_turns_and_branches_run_concurrently() -> None:
    spec = SessionSpec(
        "p1",
        0.0,
        2048,
        (Turn(4000, 400, 0.0), Turn(500, 300, 0.5, parallel=3), Turn(500, 200, 0.5)),
        branches=(
            SessionSpec("p1/a00", 0.1, 1024, (Turn(2000, 300, 0.0), Turn(300, 100, 0.2)), parent="p1",
                        spawn_after_turn=0),
        ),
    )
    res = run_sim([spec], SimConfig(replicas=2, policy="kv_aware", sample_interval_s=0.05, seed=1))
    recs = sorted(res.records, key=lambda r: r.t_start)
    assert len(recs) == 1 + 3 + 1 + 2 and all(r.ok for r in recs)
    assert all(r.session_id == "p1" for r in recs)  # branches route with the root id
    t_par = [r.t_start for r in recs if r.input_tokens == 2048 + 4000 + 400 + 500]
    assert len(t_par) == 3 and len(set(t_par)) == 1  # the three copies leave together
    last = recs[-1]
    assert last.input_tokens == 2048 + 4000 + 400 + 500 + 300 + 500
    assert last.t_start >= max(r.t_start + r.e2e_s for r in recs if r.t_start == t_par[0]) + 0.5 - 1e-9
    # the branch (spawned 0.1 s after turn 0) runs while the parent's parallel turn does
    branch = next(r for r in recs if r.input_tokens == 1024 + 2000)
    first = next(r for r in recs if r.input_tokens == 2048 + 4000)
    assert branch.t_start == pytest.approx(first.t_start + first.e2e_s + 0.1)
    assert branch.t_start < t_par[0] + min(r.e2e_s for r in recs if r.t_start == t_par[0])
    assert branch.t_start + branch.e2e_s > t_par[0]
    # later turns hit the prefix the earlier ones left in the cache
    assert last.cached_tokens > 0.9 * last.ideal_cached_tokens > 0


def test_simulator_imports_no_aiohttp() -> None:
    import subprocess
    import sys

    code = "import sys, loadtests.sim.cli, loadtests.sim.run; assert 'aiohttp' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class _ScanCheckingPolicy:
    """Routes each request twice: on the snapshot as given (the store's running totals and index)
    and on the same replicas without them (the policy scans), from the same rng state; both
    decisions, and the rng states after them, must be identical."""

    def __init__(self, name: str) -> None:
        self.fast = make_policy(name, PolicyParams())
        self.name = name
        self.calls = 0

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        assert snapshot.totals == fleet_totals(snapshot.replicas)
        assert snapshot.positions is not None
        assert all(snapshot.positions[r.id] == i for i, r in enumerate(snapshot.replicas))
        scan_rng = random.Random()
        scan_rng.setstate(rng.getstate())
        scan_snapshot = replace(snapshot, totals=None, positions=None)
        outcomes = []
        for policy, snap, r in ((make_policy(self.name, PolicyParams()), scan_snapshot, scan_rng),
                                (self.fast, snapshot, rng)):
            try:
                outcomes.append(policy.route(request, snap, r))
            except NoReplicaError as exc:
                outcomes.append(exc)
        scan, fast = outcomes
        assert repr(fast) == repr(scan) and rng.getstate() == scan_rng.getstate()
        self.calls += 1
        if isinstance(fast, NoReplicaError):
            raise fast
        return fast


@pytest.mark.parametrize("policy", ["kv_aware", "hash"])
@pytest.mark.parametrize("gateways", [1, 3])
def test_running_totals_give_the_decisions_of_a_scan(small_specs: list[SessionSpec], policy: str, gateways: int) -> None:
    checking = _ScanCheckingPolicy(policy)
    cfg = _small_cfg(
        policy,
        gateways=gateways,
        state_lag_s=0.2 if gateways > 1 else 0.0,
        duration_s=100.0,
        scale=(ScaleEvent(40.0, 10), ScaleEvent(80.0, 7)),
        failures=(FailureEvent(60.0, 1),),
    )
    res = run_sim(small_specs, cfg, policy=checking)
    assert checking.calls > 300 and res.stats["retries"] > 0


def _cached_tokens_of(cache: Any, turns: list[list[int]]) -> list[int]:
    """Admit each prompt (block hashes), store it, release it; the device tokens each one found."""
    found = []
    for hashes in turns:
        got = cache.try_lock(hashes, len(hashes) * cache.page_size)
        assert got is not None
        lease, m = got
        cache.insert(lease, hashes[m.device_blocks + m.host_blocks :])
        cache.release(lease)
        found.append(m.device_tokens)
    return found


@pytest.mark.parametrize("whole_nodes", [True, False])
def test_simulated_replicas_evict_as_the_emulator_does(whole_nodes: bool) -> None:
    """A simulated replica's cache is the emulator's for the same profile, eviction granularity
    included (SGLang's whole radix nodes by default), so the same prompts find the same tokens."""
    from loadtests.sim.replica_model import SimReplica
    from replica.emulator.server import EmulatorConfig, Replica

    profile = Profile(kv_capacity_tokens=40, host_capacity_tokens=0, page_size=4, evict_whole_nodes=whole_nodes)
    # a session's two turns, another session, a third that needs one block more than is free, then
    # the first session's second turn again: whole nodes drop that turn's extension, the finer
    # model one block of it (``tests/replica/test_emulator_cache.py``)
    t1 = [hash((1, i)) & 0xFFFFFFFF for i in range(3)]
    t2 = t1 + [hash((1, i)) & 0xFFFFFFFF for i in range(3, 6)]
    turns = [t1, t2, [hash((2, i)) & 0xFFFFFFFF for i in range(2)], [hash((3, i)) & 0xFFFFFFFF for i in range(3)], t2]
    simulated = _cached_tokens_of(SimReplica.make(0, profile).engine.cache, turns)
    emulated = _cached_tokens_of(Replica(EmulatorConfig(profile=profile)).cache, turns)
    assert simulated == emulated
    other = _cached_tokens_of(
        SimReplica.make(0, replace(profile, evict_whole_nodes=not whole_nodes)).engine.cache, turns
    )
    assert other != simulated  # the sequence tells the two granularities apart


def test_pooled_bound_follows_a_scale_up(small_specs: list[SessionSpec]) -> None:
    """``pooled_chr`` pools the KV of the replicas serving now: after a scale-up the bound grows
    with the fleet. It used to stay at the first fleet's size: then the doubled fleet hit more than
    its "bound" (routing loss -0.0035 here) and the pool was no higher than the small fleet's."""
    up = run_sim(small_specs, _small_cfg("kv_aware", scale=(ScaleEvent(30.0, 16),))).measures
    small = run_sim(small_specs, _small_cfg("kv_aware")).measures
    assert up["routing_loss"] > 0, up["routing_loss"]
    assert up["pooled_chr"] > small["pooled_chr"] + 0.004


@pytest.mark.parametrize(("host_tokens", "spills"), [(16_384, 1), (0, 0)], ids=["host-tier", "no-host-tier"])
def test_a_warm_turn_behind_a_long_prefill_spills_in_the_simulator_as_in_the_gateway(
    host_tokens: int, spills: int
) -> None:
    """The simulator's side of tests/router/test_queue_spill_functional.py: the session's sub-agent
    opens with a 6k-token prompt at home, and the main conversation's next turn, sent while that
    prefills, goes to the other replica (rule 8) where its host tier has room, for that turn only."""
    spec = SessionSpec(
        "q1",
        0.0,
        100,
        (Turn(100, 2, 0.0), Turn(20, 2, 0.01), Turn(20, 2, 1.0)),
        branches=(SessionSpec("q1/a00", 0.0, 100, (Turn(6_000, 2, 0.0),), parent="q1", spawn_after_turn=0),),
    )
    profile = default_profile().with_overrides(
        kv_capacity_tokens=8_192, host_capacity_tokens=host_tokens, page_size=16, context_length=16_384
    )
    res = run_sim([spec], SimConfig(replicas=2, profile=profile, policy="kv_aware", scrape_interval_s=0.001, seed=1))
    reasons = res.measures["route_reasons"]
    assert reasons.get("queue_spill", 0) == spills
    assert reasons.get("placed_new") == 1 and sum(reasons.values()) == 4


def _chat(sid: str, turns: int) -> SessionSpec:
    return SessionSpec(
        sid, 0.0, shared_prefix_tokens=400, turns=tuple(Turn(300, 20, think_s=2.0 if k else 0.0) for k in range(turns))
    )


@pytest.mark.parametrize("striped", [True, False])
def test_lanes_spent_names_lanes_that_ran_out_of_sessions(striped: bool) -> None:
    """Both ways of running lanes report the lanes whose sessions ran out before the window ended, as
    the live driver does: a small pool is spent early, a large one not within a short window."""
    cfg = SimConfig(replicas=2, profile=default_profile(256), lanes=2, striped_lanes=striped, duration_s=600.0)
    pool = [_chat(f"s{i}", 3) for i in range(5)]
    m = run_sim(pool, cfg).measures
    assert m["requests"] == 15 and m["lanes_spent"] == 2
    # a lane with no session at all is spent from the start
    assert run_sim(pool[:2], replace(cfg, lanes=3)).measures["lanes_spent"] == 3
    # a pool the window does not reach the end of: no lane is spent
    long = [_chat(f"l{i}", 40) for i in range(4)]
    m = run_sim(long, replace(cfg, duration_s=30.0)).measures
    assert m["requests"] > 0 and m["lanes_spent"] == 0
    # without lanes (each session at its own start time) there is no figure
    assert run_sim(pool, replace(cfg, lanes=0, striped_lanes=False)).measures["lanes_spent"] is None

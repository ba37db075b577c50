"""Hypothesis properties of the policies, on random snapshots and through ``MemoryCore``."""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.clock import VirtualClock
from router.errors import NoReplicaError
from router.model import (
    BindSession,
    Completion,
    KeySource,
    Lease,
    Reason,
    ReplicaSpec,
    ReplicaStatus,
    RouteRequest,
    SetOverflow,
)
from router.policy import POLICIES, KvAwarePolicy, PolicyParams, make_policy
from router.policy.kv_aware import BOUNDED_LOAD_EPSILON
from router.store.base import StoreConfig
from router.store.memory import MemoryCore
from tests.builders import replica, session, snapshot
from tests.strategies import Scenario, policy_params, scenarios

S = ReplicaStatus
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _servable(sc: Scenario) -> list[str]:
    return [
        r.id for r in sc.snap.replicas if r.id not in sc.req.excluded and r.status in (S.ACTIVE, S.DRAINING)
    ]


@FAST
@given(sc=scenarios(), params=policy_params(), seed=st.integers(0, 2**32 - 1))
def test_kv_aware_picks_only_eligible_replicas(sc: Scenario, params: PolicyParams, seed: int) -> None:
    policy = KvAwarePolicy(params)
    try:
        d = policy.route(sc.req, sc.snap, random.Random(seed))
    except NoReplicaError:
        assert not _servable(sc)  # it only gives up when nothing at all can serve
        return
    rep = sc.snap.replica(d.replica_id)
    assert rep is not None
    assert d.replica_id not in sc.req.excluded
    assert rep.status not in (S.JOINING, S.DOWN)
    ids = {r.id for r in sc.snap.replicas}
    sess = sc.snap.session
    for eff in d.effects:
        assert eff.session_id == sc.req.session_key
        if isinstance(eff, BindSession):
            assert eff.replica_id == d.replica_id
            assert eff.only_if == (sess.home if sess is not None else None)
            assert eff.replica_id != eff.only_if
        elif isinstance(eff, SetOverflow):
            assert sess is not None
            added = set(eff.replicas) - set(sess.overflow)
            assert added <= ids - sc.req.excluded  # never grows onto a failed/unknown replica
            assert sess.home not in eff.replicas
            if added:
                assert len(eff.replicas) <= params.max_overflow
            else:
                assert set(eff.replicas) < set(sess.overflow)  # a collapse only drops
    for _, score in d.scores:
        assert math.isfinite(score) and score >= 0.0
    if sc.req.session_key is None:
        assert d.effects == ()


@FAST
@given(sc=scenarios(min_replicas=1), params=policy_params(), seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_decision_and_keyed_decisions_ignore_rng(
    sc: Scenario, params: PolicyParams, seed: int
) -> None:
    for name in POLICIES:
        policy = make_policy(name, params)
        try:
            first = policy.route(sc.req, sc.snap, random.Random(seed))
        except NoReplicaError:
            continue
        assert policy.route(sc.req, sc.snap, random.Random(seed)) == first
        if name == "kv_aware" and sc.req.session_key is not None:
            # two gateways with different rngs agree on a keyed request
            assert policy.route(sc.req, sc.snap, random.Random(seed + 1)) == first


@FAST
@given(sc=scenarios(min_replicas=1), params=policy_params(), seed=st.integers(0, 2**32 - 1))
def test_baselines_never_pick_ineligible(sc: Scenario, params: PolicyParams, seed: int) -> None:
    for name in ("random", "round_robin", "least_loaded", "hash"):
        try:
            d = make_policy(name, params).route(sc.req, sc.snap, random.Random(seed))
        except NoReplicaError:
            assert not [r for r in sc.snap.replicas if r.status is S.ACTIVE and r.id not in sc.req.excluded]
            continue
        rep = sc.snap.replica(d.replica_id)
        assert rep is not None and rep.status is S.ACTIVE and rep.id not in sc.req.excluded
        assert d.effects == ()


@FAST
@given(
    n=st.integers(2, 12),
    loads=st.lists(st.integers(0, 7), min_size=12, max_size=12),
    home_idx=st.integers(0, 11),
    at_home=st.integers(0, 2),
    ctx=st.integers(30_000, 400_000),
    seed=st.integers(0, 1000),
)
def test_session_stays_home_while_healthy_and_under_bound(
    n: int, loads: list[int], home_idx: int, at_home: int, ctx: int, seed: int
) -> None:
    reps = [replica(f"r{i:02d}", in_flight=loads[i], sessions=loads[i] + 1) for i in range(n)]
    home = reps[home_idx % n].id
    sess = session("s1", home, in_flight={home: at_home}, ctx=ctx, mark=0)
    d = KvAwarePolicy().route(RouteRequest("s1"), snapshot(*reps, sess=sess), random.Random(seed))
    # below the hard bound (8), the thicc threshold (3), not thrashing, too big to move cheaply
    assert (d.replica_id, d.reason) == (home, Reason.AFFINITY)
    assert not any(isinstance(e, BindSession) for e in d.effects)


# ---- through MemoryCore: snapshot -> route -> acquire -> release -----------------------------------


def _core(n: int, clock: VirtualClock) -> MemoryCore:
    core = MemoryCore(clock, StoreConfig(active_window_s=600.0, ramp_window_s=10.0, session_ttl_s=3600.0))
    for i in range(n):
        core.upsert_replica(
            ReplicaSpec(id=f"r{i:02d}", url=f"http://r{i:02d}", capacity_tokens=850_000), ReplicaStatus.ACTIVE
        )
    return core


def _turn(
    core: MemoryCore, policy: KvAwarePolicy, sid: str, rng: random.Random, prompt: int, cached: int
) -> tuple[Lease, Reason]:
    snap = core.snapshot(sid)
    req = RouteRequest(sid, KeySource.HEADER, prompt_tokens_estimate=prompt)
    d = policy.route(req, snap, rng)
    lease = core.acquire(d, req)
    return lease, d.reason


def _done(core: MemoryCore, lease: Lease, prompt: int, cached: int) -> None:
    core.release(
        lease, Completion(ok=True, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=200)
    )


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 12),
    n_sessions=st.integers(10, 150),
    hold=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_bounded_load_holds_through_memory_core(n: int, n_sessions: int, hold: int, seed: int) -> None:
    clock = VirtualClock(0.0)
    core = _core(n, clock)
    policy = KvAwarePolicy()
    rng = random.Random(seed)
    held: list[tuple[Lease, int]] = []
    for i in range(n_sessions):
        clock.advance(0.05)
        prompt = rng.randint(1_000, 60_000)
        lease, reason = _turn(core, policy, f"s{i}", rng, prompt, 0)
        assert reason is Reason.PLACED_NEW
        held.append((lease, prompt))
        while len(held) > hold:
            old, p = held.pop(0)
            _done(core, old, p, 0)
        counts = [r.sessions_active for r in core.replicas()]
        assert max(counts) <= math.ceil((1 + BOUNDED_LOAD_EPSILON) * (i + 1) / n)
    assert sum(r.sessions_active for r in core.replicas()) == n_sessions


def _warm_fleet(
    n: int, n_sessions: int, seed: int
) -> tuple[MemoryCore, VirtualClock, KvAwarePolicy, dict[str, str]]:
    clock = VirtualClock(0.0)
    core = _core(n, clock)
    policy = KvAwarePolicy()
    rng = random.Random(seed)
    for turn in range(3):
        for i in range(n_sessions):
            clock.advance(0.01)
            prompt = 20_000 + 1_000 * turn
            lease, _ = _turn(core, policy, f"s{i}", rng, prompt, 0)
            _done(core, lease, prompt, prompt - 1_000 if turn else 0)
    homes = {f"s{i}": core.session(f"s{i}").home for i in range(n_sessions)}  # type: ignore[union-attr]
    return core, clock, policy, homes  # type: ignore[return-value]


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(2, 10), n_sessions=st.integers(5, 60), added=st.integers(1, 4), seed=st.integers(0, 1000)
)
def test_adding_replicas_moves_no_session(n: int, n_sessions: int, added: int, seed: int) -> None:
    core, clock, policy, homes = _warm_fleet(n, n_sessions, seed)
    for j in range(added):
        core.upsert_replica(ReplicaSpec(id=f"new{j}", url=f"http://new{j}"), ReplicaStatus.ACTIVE)
    rng = random.Random(seed)
    for sid, home in homes.items():
        clock.advance(0.01)
        lease, reason = _turn(core, policy, sid, rng, 30_000, 0)
        assert (lease.replica_id, reason) == (home, Reason.AFFINITY)
        _done(core, lease, 30_000, 29_000)
    # ...while new sessions do land on the new replicas
    placed_new = set()
    for i in range(40):
        clock.advance(0.01)
        lease, _ = _turn(core, policy, f"fresh{i}", rng, 30_000, 0)
        placed_new.add(lease.replica_id)
        _done(core, lease, 30_000, 0)
    assert any(rid.startswith("new") for rid in placed_new)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(3, 10),
    n_sessions=st.integers(5, 60),
    victim=st.integers(0, 9),
    how=st.sampled_from(["remove", "down", "draining"]),
    seed=st.integers(0, 1000),
)
def test_removing_a_replica_moves_only_its_sessions(
    n: int, n_sessions: int, victim: int, how: str, seed: int
) -> None:
    core, clock, policy, homes = _warm_fleet(n, n_sessions, seed)
    gone = f"r{victim % n:02d}"
    if how == "remove":
        core.remove_replica(gone)
    else:
        core.set_status(gone, ReplicaStatus.DOWN if how == "down" else ReplicaStatus.DRAINING)
    rng = random.Random(seed)
    expected_reason = Reason.REASSIGNED_DRAINING if how == "draining" else Reason.REASSIGNED_GONE
    for sid, home in homes.items():
        clock.advance(0.01)
        lease, reason = _turn(core, policy, sid, rng, 30_000, 0)
        if home == gone:
            assert lease.replica_id != gone and reason is expected_reason
            assert core.session(sid).home == lease.replica_id  # type: ignore[union-attr]
        else:
            assert (lease.replica_id, reason) == (home, Reason.AFFINITY)
        _done(core, lease, 30_000, 29_000)

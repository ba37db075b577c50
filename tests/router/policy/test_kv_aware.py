"""Table-driven tests of ``kv_aware``: exact decisions on hand-built snapshots, one rule at a time."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from router.errors import NoReplicaError
from router.model import (
    AffinityBreak,
    BindSession,
    ClusterSnapshot,
    Effect,
    KeySource,
    Reason,
    ReplicaStatus,
    RouteRequest,
    SetOverflow,
)
from router.policy.hashing import hrw_top
from router.policy.kv_aware import KvAwarePolicy, cache_surely_gone, load_score, load_scores
from router.policy.params import PolicyParams
from tests.builders import CAPACITY, replica, request, session, snapshot

A, B, C, D = "a", "b", "c", "d"
S = ReplicaStatus
P = PolicyParams()


@dataclass(frozen=True)
class Case:
    snap: ClusterSnapshot
    req: RouteRequest
    replica: str
    reason: Reason
    effects: tuple[Effect, ...] = ()
    brk: AffinityBreak | None = None
    params: PolicyParams = field(default_factory=PolicyParams)


def bind(rid: str, only_if: str | None, reason: Reason, sid: str = "s1") -> BindSession:
    return BindSession(sid, rid, only_if=only_if, reason=reason)


# the working set of a home with 6 requests in flight: 600k of its 850k. Enough cache pressure for a
# soft move in these light fleets (light_move_pressure 1.5 × (1 − mean / 4) × 850k is at most
# 531.25k here), so the rule-5 cases below test the price of a move, not that pressure test
BUSY_WS = 600_000

# ---- shared by the rule-5 cases of round 6 (docs/POLICY.md) ------------------------------------------
# a 100k-token session on A (6 in flight, queue 2) in a light fleet (mean 7/3) ...
_LIGHT_FLEET = snapshot(
    replica(A, in_flight=6, active_ctx=BUSY_WS, queued=2), replica(B), replica(C, in_flight=1), sess=session("s1", A, ctx=100_000)
)
# ... and in a saturated one: every engine reports a queue (mean 4)
_SATURATED_FLEET = snapshot(
    replica(A, in_flight=6, active_ctx=BUSY_WS, queued=2),
    replica(B, queued=1),
    replica(C, in_flight=6, queued=1),
    sess=session("s1", A, ctx=100_000),
)


# a 10k-token session s1 idle on A (6 in flight; `home` sets A's engine and cache figures) in a light
# fleet (mean 7/3): the shape of rule 5's soft-move cases and of its light-fleet pressure test
def _busy_home(**home: int) -> ClusterSnapshot:
    return snapshot(replica(A, in_flight=6, **home), replica(B), replica(C, in_flight=1), sess=session("s1", A, ctx=10_000))


# a working set past a replica's whole KV (850k, no host tier): it evicts its own sessions, where
# the hard bound applies (rule 1)
KV_BOUND = CAPACITY + 50_000


# a home over the hard bound (A at 9 in flight, bound 8) with the 50k session s1 idle on it, in a fleet
# of `sessions` active sessions per replica (round 7's crowding limit is 12); `ws`: A's working set
def _hot_home(sessions: int = 0, ws: int = KV_BOUND, host: int = 0) -> ClusterSnapshot:
    return snapshot(
        replica(A, in_flight=9, sessions=sessions, active_ctx=ws, host=host),
        replica(B, sessions=sessions),
        replica(C, in_flight=1, sessions=sessions),
        sess=session("s1", A),
    )


# the expected decision when s1 moves from A to B at its turn start
_MOVED_TO_B = (
    B,
    Reason.REASSIGNED_OVERLOAD,
    (bind(B, A, Reason.REASSIGNED_OVERLOAD),),
    AffinityBreak.OVERLOAD_SPILL,
)

CASES: dict[str, Case] = {
    # ---- rule 1: affinity
    "affinity_home_busier_than_others": Case(
        snapshot(replica(A, in_flight=3), replica(B), replica(C), sess=session("s1", A)),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "affinity_mid_turn_below_thicc": Case(
        snapshot(replica(A, in_flight=2), replica(B), sess=session("s1", A, in_flight={A: 2})),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "affinity_draining_home_mid_turn": Case(
        snapshot(
            replica(A, status=S.DRAINING, in_flight=1), replica(B), sess=session("s1", A, in_flight={A: 1})
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "affinity_unknown_residency_mark": Case(
        snapshot(replica(A, written=9_000_000), replica(B), sess=session("s1", A, mark=0)),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "affinity_host_tier_keeps_cache": Case(
        snapshot(
            replica(A, written=2_000_000, host=2_000_000, in_flight=3),
            replica(B),
            sess=session("s1", A, mark=100_000),
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "affinity_collapses_idle_overflow": Case(
        snapshot(
            replica(A, in_flight=1),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, overflow=(B, C), in_flight={A: 1, C: 1}),
        ),
        request(),
        A,
        Reason.AFFINITY,
        (SetOverflow("s1", (C,)),),
    ),
    "affinity_big_session_not_moved_by_soft_overload": Case(
        snapshot(
            replica(A, in_flight=6, active_ctx=BUSY_WS, queued=2),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, ctx=400_000),
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    # ---- rule 3: placement
    "new_least_in_flight": Case(
        snapshot(replica(A, in_flight=2), replica(B), replica(C, in_flight=1)),
        request(),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
    ),
    "new_avoids_full_working_set": Case(
        snapshot(replica(A, active_ctx=1_600_000), replica(B, in_flight=2)),
        request(prompt=50_000),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
    ),
    "new_active_sessions_come_back": Case(
        snapshot(replica(A, sessions=12), replica(B, in_flight=1, sessions=2)),
        request(),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
    ),
    "new_bounded_load_skips_session_heavy_idle_replica": Case(
        # 15 active sessions on 3 replicas: cap = ceil(1.25 * 16 / 3) = 7, so A (10) is out
        snapshot(
            replica(A, sessions=10), replica(B, sessions=2, in_flight=2), replica(C, sessions=3, in_flight=4)
        ),
        request(),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
        params=P.with_changes(w_sessions=0.0),
    ),
    "new_never_draining": Case(
        snapshot(replica(A, status=S.DRAINING), replica(B, in_flight=3)),
        request(),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
    ),
    "new_never_joining_or_down": Case(
        snapshot(
            replica(A, status=S.JOINING),
            replica(B, status=S.DOWN),
            replica(C, in_flight=5),
            replica(D, in_flight=6),
        ),
        request(),
        C,
        Reason.PLACED_NEW,
        (bind(C, None, Reason.PLACED_NEW),),
        params=P.with_changes(panic_threshold=0.0),
    ),
    "new_never_excluded": Case(
        snapshot(replica(A), replica(B, in_flight=1), replica(C, in_flight=2)),
        request(excluded={A}),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW),),
    ),
    "prefix_key_placed_like_a_session": Case(
        snapshot(replica(A, in_flight=1), replica(B)),
        request("pabc", source=KeySource.PREFIX),
        B,
        Reason.PLACED_NEW,
        (bind(B, None, Reason.PLACED_NEW, sid="pabc"),),
    ),
    "no_key_least_loaded_no_effects": Case(
        snapshot(replica(A, in_flight=1), replica(B), replica(C, in_flight=2)),
        request(None),
        B,
        Reason.PLACED_NEW,
    ),
    # ---- rule 4: fresh replicas
    "fresh_replica_takes_new_session": Case(
        snapshot(
            replica(A, in_flight=2),
            replica(B, in_flight=2),
            replica(C, in_flight=2),
            replica(D, joined_at=990.0),
        ),
        request(),
        D,
        Reason.PLACED_NEW,
        (bind(D, None, Reason.PLACED_NEW),),
    ),
    "fresh_replica_ramp_capped": Case(
        # 6 recent placements on 4 replicas: share = ceil(1.5 * 7 / 4) = 3, D already took 3
        snapshot(
            replica(A, in_flight=1, placed=1),
            replica(B, in_flight=2, placed=1),
            replica(C, in_flight=2, placed=1),
            replica(D, joined_at=990.0, placed=3),
        ),
        request(),
        A,
        Reason.PLACED_NEW,
        (bind(A, None, Reason.PLACED_NEW),),
    ),
    "old_replica_is_not_ramp_capped": Case(
        snapshot(
            replica(A, in_flight=1, placed=1),
            replica(B, in_flight=2, placed=1),
            replica(C, in_flight=2, placed=1),
            replica(D, joined_at=700.0, placed=3),
        ),
        request(),
        D,
        Reason.PLACED_NEW,
        (bind(D, None, Reason.PLACED_NEW),),
    ),
    "replica_joined_by_scale_up_takes_a_session_whose_home_is_gone": Case(
        # D joined 300 s ago (past its ramp window): s1 moves because its home is down, not because D
        # joined, and the least loaded replica takes it (rule 4 keeps *warm* sessions where they are;
        # until round 29 a young replica took no re-homed session for 600 s)
        snapshot(
            replica(A, status=S.DOWN),
            replica(B, in_flight=2),
            replica(D, joined_at=700.0),
            sess=session("s1", A),
        ),
        request(),
        D,
        Reason.REASSIGNED_GONE,
        (bind(D, A, Reason.REASSIGNED_GONE),),
        AffinityBreak.REPLICA_GONE,
    ),
    "initial_fleet_is_not_ramp_capped": Case(
        # the same: D (0.001 s) took 3 of the last placements, it is no fresh replica
        snapshot(
            replica(A, in_flight=1, placed=1),
            replica(B, in_flight=2, placed=1),
            replica(C, in_flight=2, placed=1),
            replica(D, joined_at=0.001, placed=3),
            now=60.0,
            serving_since=5.0,
        ),
        request(),
        D,
        Reason.PLACED_NEW,
        (bind(D, None, Reason.PLACED_NEW),),
    ),
    "grown_replica_takes_rehomed_sessions": Case(
        snapshot(
            replica(A, status=S.DOWN),
            replica(B, in_flight=2),
            replica(D, joined_at=300.0),
            sess=session("s1", A),
        ),
        request(),
        D,
        Reason.REASSIGNED_GONE,
        (bind(D, A, Reason.REASSIGNED_GONE),),
        AffinityBreak.REPLICA_GONE,
    ),
    # ---- rule 2: thicc sessions
    "thicc_opens_overflow": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 3}),
        ),
        request(),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.THICC_SPLIT,
    ),
    "thicc_reuses_sticky_overflow": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B, in_flight=1),
            replica(C),
            sess=session("s1", A, overflow=(B,), in_flight={A: 3, B: 1}),
        ),
        request(),
        B,
        Reason.THICC_SPLIT,
    ),
    "thicc_grows_second_overflow": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B, in_flight=3),
            replica(C),
            replica(D, in_flight=2),
            sess=session("s1", A, overflow=(B,), in_flight={A: 3, B: 3}),
        ),
        request(),
        C,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B, C)),),
        AffinityBreak.THICC_SPLIT,
    ),
    "thicc_at_max_overflow_goes_to_least_used": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B, in_flight=4),
            replica(C),
            sess=session("s1", A, overflow=(B,), in_flight={A: 3, B: 4}),
        ),
        request(),
        A,
        Reason.AFFINITY,
        params=P.with_changes(max_overflow=1),
    ),
    "thicc_drops_down_overflow": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B, status=S.DOWN),
            replica(C, in_flight=1),
            replica(D, in_flight=2),
            sess=session("s1", A, overflow=(B,), in_flight={A: 3}),
        ),
        request(),
        C,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (C,)),),
        AffinityBreak.THICC_SPLIT,
    ),
    # ---- rule 2, which request spills: the one extending the session context stays home
    "thicc_extending_request_stays_home": Case(
        snapshot(replica(A, in_flight=3), replica(B), replica(C), sess=session("s1", A, in_flight={A: 3})),
        request(prompt=52_000),  # session context 50k: the parent chain's next turn
        A,
        Reason.AFFINITY,
    ),
    "thicc_request_equal_to_context_stays_home": Case(
        snapshot(replica(A, in_flight=3), replica(B), replica(C), sess=session("s1", A, in_flight={A: 3})),
        request(prompt=50_000),
        A,
        Reason.AFFINITY,
    ),
    "thicc_short_request_spills": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 3}),
        ),
        request(prompt=8_000),  # a sub-agent turn
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.THICC_SPLIT,
    ),
    "thicc_extending_unknown_context_spills": Case(
        snapshot(
            replica(A, in_flight=3),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 3}, ctx=0),
        ),
        request(prompt=8_000),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.THICC_SPLIT,
    ),
    "thicc_extending_spills_over_hard_bound": Case(
        # mean in-flight 10/3 -> hard bound 8; home at 9 and KV-bound: load safety beats the cache
        snapshot(
            replica(A, in_flight=9, active_ctx=KV_BOUND),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 3}),
        ),
        request(prompt=52_000),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.OVERLOAD_SPILL,
    ),
    # ---- rule 2, per conversation: a sub-agent's next turn goes where its previous turn went
    "chain_continues_on_its_overflow": Case(
        # sub-agent "k2" last ran on the overflow B; home has room again: its context is on B
        snapshot(
            replica(A, in_flight=1),
            replica(B, in_flight=1),
            replica(C),
            sess=session("s1", A, overflow=(B,), in_flight={A: 1}, chains=(("k1", A), ("k2", B))),
        ),
        request(prompt=9_000, chain="k2"),
        B,
        Reason.THICC_SPLIT,
    ),
    "chain_continues_on_a_collapsed_overflow": Case(
        # the session went idle and its overflow collapsed: B comes back into the set with the chain
        snapshot(replica(A), replica(B), replica(C), sess=session("s1", A, chains=(("k2", B),))),
        request(prompt=9_000, chain="k2"),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
    ),
    "chain_at_home_follows_the_session_rules": Case(
        # a conversation whose previous turn ran at home spills like any sub-agent when home is thicc
        snapshot(
            replica(A, in_flight=3), replica(B), replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 3}, chains=(("k2", A),)),
        ),
        request(prompt=9_000, chain="k2"),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.THICC_SPLIT,
    ),
    "chain_not_followed_over_the_hard_bound": Case(
        # B is over the hard bound (8): the conversation's cache does not outweigh load safety
        snapshot(
            replica(A, in_flight=1), replica(B, in_flight=9), replica(C),
            sess=session("s1", A, overflow=(B,), chains=(("k2", B),)),
        ),
        request(prompt=9_000, chain="k2"),
        A,
        Reason.AFFINITY,
        (SetOverflow("s1", ()),),
    ),
    "chain_not_followed_to_a_down_replica": Case(
        snapshot(replica(A), replica(B, status=S.DOWN), replica(C), sess=session("s1", A, chains=(("k2", B),))),
        request(prompt=9_000, chain="k2"),
        A,
        Reason.AFFINITY,
    ),
    "chain_not_followed_past_max_overflow": Case(
        # the session already spans home + max_overflow replicas: a third is not opened for it
        snapshot(
            replica(A), replica(B, in_flight=1), replica(C),
            sess=session("s1", A, overflow=(B,), in_flight={B: 1}, chains=(("k2", C),)),
        ),
        request(prompt=9_000, chain="k2"),
        A,
        Reason.AFFINITY,
        params=P.with_changes(max_overflow=1),
    ),
    "overload_mid_turn_spills": Case(
        # mean in-flight 3 -> hard bound max(8, 6) = 8; A is at 9 and KV-bound
        snapshot(
            replica(A, in_flight=9, active_ctx=KV_BOUND),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 1}),
        ),
        request(),
        B,
        Reason.THICC_SPLIT,
        (SetOverflow("s1", (B,)),),
        AffinityBreak.OVERLOAD_SPILL,
    ),
    # ---- rule 5: reassignment at turn start
    "overload_idle_reassigns": Case(
        # home over the hard bound (8); the 50k session's move needs 1.5 + 50k / 20.8k = 3.9 < 8.75
        _hot_home(),
        request(),
        *_MOVED_TO_B,
    ),
    "overload_idle_reassigns_in_a_saturated_fleet": Case(
        # every engine queues, but home is over the hard bound: saturation stops soft moves only
        snapshot(
            replica(A, in_flight=9, queued=1, active_ctx=KV_BOUND),
            replica(B, queued=1),
            replica(C, in_flight=1, queued=1),
            sess=session("s1", A),
        ),
        request(),
        *_MOVED_TO_B,
    ),
    "overload_idle_big_warm_session_leaves_too": Case(
        # the same hot home (hard bound 8, A at 9, KV-bound) with a big warm session: the bound is
        # hard at a turn start (rule 1), whatever the move's re-prefill costs
        snapshot(
            replica(A, in_flight=9, active_ctx=KV_BOUND), replica(B), replica(C, in_flight=1), sess=session("s1", A, ctx=200_000)
        ),
        request(),
        *_MOVED_TO_B,
    ),
    "overload_idle_stays_when_no_one_is_under_the_bound": Case(
        # hard bound = max(8, 1.0 * mean 9.33) = 9.33: B and C would be over it with one more
        snapshot(
            replica(A, in_flight=10, active_ctx=KV_BOUND),
            replica(B, in_flight=9),
            replica(C, in_flight=9),
            sess=session("s1", A),
        ),
        request(),
        A,
        Reason.AFFINITY,
        params=P.with_changes(hard_bound_factor=1.0),
    ),
    # ---- rule 1's bound where the home's working set fits its KV (docs/POLICY.md round 25)
    "over_the_bound_but_not_kv_bound_keeps_its_idle_session": Case(
        # the hot home of overload_idle_reassigns with a working set that fits its HBM: the turn is
        # warm at home and its wait is a few seconds of prefill and decode; a move re-prefills the
        # whole context and queues the target as long
        _hot_home(ws=CAPACITY - 50_000),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "over_the_bound_but_not_kv_bound_with_a_host_tier": Case(
        # past its HBM but within HBM + host tier (HiCache): the working set is still held
        _hot_home(ws=KV_BOUND, host=CAPACITY),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "over_the_bound_but_not_kv_bound_mid_turn_stays": Case(
        # mid-turn at the same home: no spill either (a thicc session still splits, rule 2)
        snapshot(
            replica(A, in_flight=9, active_ctx=CAPACITY - 50_000),
            replica(B),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 1}),
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "draining_home_idle_reassigns": Case(
        snapshot(
            replica(A, status=S.DRAINING),
            replica(B, in_flight=2),
            replica(C, in_flight=1),
            sess=session("s1", A, overflow=(B,)),
        ),
        request(),
        C,
        Reason.REASSIGNED_DRAINING,
        (bind(C, A, Reason.REASSIGNED_DRAINING), SetOverflow("s1", ())),
        AffinityBreak.REPLICA_GONE,
    ),
    "down_home_reassigns": Case(
        snapshot(
            replica(A, status=S.DOWN),
            replica(B, in_flight=2),
            replica(C, in_flight=1),
            sess=session("s1", A, in_flight={A: 1}),
        ),
        request(),
        C,
        Reason.REASSIGNED_GONE,
        (bind(C, A, Reason.REASSIGNED_GONE),),
        AffinityBreak.REPLICA_GONE,
    ),
    "removed_home_reassigns": Case(
        snapshot(replica(B, in_flight=2), replica(C, in_flight=1), sess=session("s1", "gone")),
        request(),
        C,
        Reason.REASSIGNED_GONE,
        (bind(C, "gone", Reason.REASSIGNED_GONE),),
        AffinityBreak.REPLICA_GONE,
    ),
    # ---- rule 6: residency
    "evicted_placed_afresh": Case(
        snapshot(
            replica(A, written=2_000_000, in_flight=3),
            replica(B, in_flight=1),
            replica(C, in_flight=2),
            sess=session("s1", A, mark=100_000),
        ),
        request(),
        B,
        Reason.PLACED_EVICTED,
        (bind(B, A, Reason.PLACED_EVICTED),),
        AffinityBreak.EVICTED,
    ),
    "evicted_home_still_best": Case(
        snapshot(
            replica(A, written=2_000_000),
            replica(B, in_flight=1),
            replica(C, in_flight=2),
            sess=session("s1", A, mark=100_000),
        ),
        request(),
        A,
        Reason.PLACED_EVICTED,
        (),
        AffinityBreak.EVICTED,
    ),
    "evicted_by_the_engines_residency_horizon": Case(
        # A wrote 300k since s1's turn: within its 850k cache, but the engine's answers showed its
        # sessions' caches gone after 200k (rule 6 feedback): placed afresh by load
        snapshot(
            replica(A, written=400_000, in_flight=3, horizon=200_000),
            replica(B, in_flight=1),
            replica(C, in_flight=2),
            sess=session("s1", A, mark=100_000),
        ),
        request(),
        B,
        Reason.PLACED_EVICTED,
        (bind(B, A, Reason.PLACED_EVICTED),),
        AffinityBreak.EVICTED,
    ),
    "resident_by_the_estimate_without_feedback": Case(
        # the same without feedback: 300k < 850k, resident, home
        snapshot(
            replica(A, written=400_000, in_flight=3),
            replica(B, in_flight=1),
            replica(C, in_flight=2),
            sess=session("s1", A, mark=100_000),
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    "evicted_mid_turn_stays_home": Case(
        snapshot(
            replica(A, written=2_000_000, in_flight=3),
            replica(B, in_flight=1),
            sess=session("s1", A, mark=100_000, in_flight={A: 1}),
        ),
        request(),
        A,
        Reason.AFFINITY,
    ),
    # ---- rule 8: failures
    "retry_avoids_failed_home_without_rebind": Case(
        snapshot(replica(A), replica(B, in_flight=2), replica(C, in_flight=1), sess=session("s1", A)),
        request(excluded={A}),
        C,
        Reason.RETRY,
        (),
        AffinityBreak.REPLICA_GONE,
    ),
    "panic_routes_to_draining": Case(
        # 1 of 4 non-excluded replicas ACTIVE < 50 %: route among ACTIVE + DRAINING, bounds off
        snapshot(
            replica(A, status=S.DOWN),
            replica(B, status=S.DOWN),
            replica(C, status=S.DRAINING),
            replica(D, in_flight=5),
        ),
        request(),
        C,
        Reason.PLACED_NEW,
        (bind(C, None, Reason.PLACED_NEW),),
    ),
    "joining_replicas_do_not_make_a_panic": Case(
        # a scale-up from 2 to 5: 2 ACTIVE of 5 registered is not "fewer than half healthy", so the
        # hard bound still holds and s1 leaves its overloaded home at its turn start
        snapshot(
            replica(A, in_flight=9, active_ctx=KV_BOUND),
            replica(B),
            replica("j1", status=S.JOINING),
            replica("j2", status=S.JOINING),
            replica("j3", status=S.JOINING),
            sess=session("s1", A),
        ),
        request(),
        *_MOVED_TO_B,
    ),
    "no_panic_below_threshold": Case(
        snapshot(
            replica(A, status=S.DOWN),
            replica(B, status=S.DOWN),
            replica(C, status=S.DRAINING),
            replica(D, in_flight=5),
        ),
        request(),
        D,
        Reason.PLACED_NEW,
        (bind(D, None, Reason.PLACED_NEW),),
        params=P.with_changes(panic_threshold=0.2),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decision(name: str) -> None:
    case = CASES[name]
    d = KvAwarePolicy(case.params).route(case.req, case.snap, random.Random(7))
    assert (d.replica_id, d.reason) == (case.replica, case.reason)
    assert d.effects == case.effects
    assert d.expected_break == case.brk


def test_placement_scores_are_expected_delay() -> None:
    # in flight + 0.25 per active session bound here; the engine's polled queue and KV use play no
    # part (the exact in-flight count already holds them)
    snap = snapshot(
        replica(A, in_flight=2),
        replica(B, sessions=1),
        replica(C, in_flight=1, queued=2, kv_util=0.5),
        sessions_active=12,  # the bounded-load cap (6 per replica) filters nobody here
    )
    d = KvAwarePolicy().route(request(), snap, random.Random(0))
    assert d.scores == ((A, 2.0), (B, 0.25), (C, 1.0))
    assert d.replica_id == B


def test_ties_go_to_the_rendezvous_winner_of_the_session() -> None:
    snap = snapshot(*(replica(f"r{i}") for i in range(8)))
    for sid in ("s1", "s2", "s3", "another", "x" * 40):
        d = KvAwarePolicy().route(request(sid), snap, random.Random(0))
        assert d.replica_id == hrw_top(sid, [f"r{i}" for i in range(8)])
        # the rng plays no part when there is a key: racing gateways agree
        assert KvAwarePolicy().route(request(sid), snap, random.Random(99)).replica_id == d.replica_id


def test_one_session_more_is_never_a_tie_but_a_working_set_sliver_is() -> None:
    # 0.25 apart (one active session): the emptier replica wins whatever the session id
    snap = snapshot(replica(A, sessions=1), replica(B))
    winners = {KvAwarePolicy().route(request(f"s{i}"), snap, random.Random(0)).replica_id for i in range(40)}
    assert winners == {B}
    # under half a session's weight apart (a little working-set penalty): a tie, the rendezvous winner
    snap = snapshot(replica(A, active_ctx=int(0.91 * CAPACITY)), replica(B, active_ctx=int(0.9 * CAPACITY)))
    winners = {KvAwarePolicy().route(request(f"s{i}"), snap, random.Random(0)).replica_id for i in range(40)}
    assert winners == {A, B}


def test_sessions_arriving_one_after_another_split_evenly_over_idle_replicas() -> None:
    # issue 22: four sessions sent one after another to two idle replicas landed 3:1 when a
    # one-session difference (0.25) fell inside the old 0.5 tie quantum and the hash decided
    for trial in range(60):
        held = {A: 0, B: 0}
        for k in range(4):
            snap = snapshot(replica(A, sessions=held[A]), replica(B, sessions=held[B]), sessions_active=k)
            d = KvAwarePolicy().route(request(f"t{trial}-s{k}"), snap, random.Random(trial))
            held[d.replica_id] += 1
        assert held == {A: 2, B: 2}, trial


def test_no_key_ties_use_the_injected_rng() -> None:
    snap = snapshot(*(replica(f"r{i}") for i in range(8)))
    picks = [KvAwarePolicy().route(request(None), snap, random.Random(seed)).replica_id for seed in range(50)]
    assert len(set(picks)) > 3
    again = [KvAwarePolicy().route(request(None), snap, random.Random(seed)).replica_id for seed in range(50)]
    assert picks == again


@pytest.mark.parametrize(
    "snap",
    [
        snapshot(),
        snapshot(replica(A, status=S.DOWN), replica(B, status=S.JOINING)),
        snapshot(replica(A), replica(B)),  # both excluded below
    ],
)
def test_no_replica_raises(snap: ClusterSnapshot) -> None:
    with pytest.raises(NoReplicaError):
        KvAwarePolicy().route(request(excluded={A, B}), snap, random.Random(0))
    with pytest.raises(NoReplicaError):
        KvAwarePolicy().route(
            request(excluded={A, B}), snapshot(*snap.replicas, sess=session("s1", A)), random.Random(0)
        )


@pytest.mark.parametrize(
    ("written", "mark", "host", "horizon", "gone"),
    [
        (1_000_000, 100_000, 0, 0, True),  # 900k written since > 850k
        (900_000, 100_000, 0, 0, False),  # 800k < 850k
        (900_000, 100_000, 0, 700_000, True),  # the engine's answers put the horizon at 700k
        (1_000_000, 100_000, 0, 1_000_000, False),  # ... or at 1M
        (3_000_000, 100_000, 1_700_000, 0, True),  # 2.9M > 850k + 1.7M
        (2_000_000, 100_000, 1_700_000, 0, False),
        (5_000_000, 0, 0, 0, False),  # unknown mark: assume resident
    ],
)
def test_residency_estimate(written: int, mark: int, host: int, horizon: int, gone: bool) -> None:
    home = replica(A, written=written, host=host, horizon=horizon)
    assert cache_surely_gone(session("s1", A, mark=mark), home, P) is gone


def test_default_capacity_when_unknown() -> None:
    unknown = replica(A, capacity=0, written=1_000_000)
    assert cache_surely_gone(session("s1", A, mark=100_000), unknown, P)  # 900k > default 850k
    assert not cache_surely_gone(
        session("s1", A, mark=100_000), unknown, P.with_changes(default_capacity_tokens=10**6)
    )
    # working-set penalty uses the same default: 1.7M of context on an unknown replica = 2x capacity
    assert load_score(replica(A, capacity=0, active_ctx=1_700_000), 0, P) == pytest.approx(4.0 * (2.0 - 0.9))


@pytest.mark.parametrize("ctx", [-5, 0, 30_000, 900_000])
def test_load_scores_are_load_score_bit_for_bit(ctx: int) -> None:
    rng = random.Random(ctx)
    reps = [
        dataclasses.replace(
            replica(f"r{i}", capacity=rng.choice((0, 200_000, 850_000)), active_ctx=rng.randrange(2_000_000)),
            in_flight=rng.randrange(20),
            sessions_active=rng.randrange(15),
        )
        for i in range(200)
    ]
    for params in (P, P.with_changes(w_sessions=0.37, w_working_set=2.5, working_set_limit=0.6)):
        assert load_scores(reps, ctx, params) == [load_score(r, ctx, params) for r in reps]


def test_draining_home_serves_when_nothing_else_can() -> None:
    snap = snapshot(replica(A, status=S.DRAINING), replica(B, status=S.DOWN), sess=session("s1", A))
    d = KvAwarePolicy(P.with_changes(panic_threshold=0.0)).route(request(), snap, random.Random(0))
    assert (d.replica_id, d.reason, d.effects) == (A, Reason.AFFINITY, ())


@pytest.mark.parametrize(
    ("resident", "written", "gone", "check"),
    [
        (None, 2_000_000, True, ""),  # no events: the estimate decides (2M written > 850k)
        (None, 200_000, False, ""),
        (45_000, 200_000, False, "agree"),  # 45k of a 50k context resident: stays
        (45_000, 2_000_000, False, "false_gone"),  # the estimate would have moved a warm session
        (10_000, 200_000, False, "agree"),  # a fifth still resident: staying keeps that part
        (4_000, 200_000, True, "false_resident"),  # events: under a tenth left, placed afresh
        (0, 2_000_000, True, "agree"),
    ],
)
def test_exact_residency_decides_when_the_engine_publishes_it(
    resident: int | None, written: int, gone: bool, check: str
) -> None:
    sess = dataclasses.replace(session("s1", A, mark=100_000, ctx=50_000), resident_tokens=resident)
    snap = snapshot(replica(A, written=written + 100_000, in_flight=2), replica(B), sess=sess)
    d = KvAwarePolicy().route(request(), snap, random.Random(0))
    assert (d.reason is Reason.PLACED_EVICTED) is gone
    assert d.residency == ("estimate" if resident is None else "events")
    assert d.estimate_check == check


@pytest.mark.parametrize(
    ("resident_on", "excluded", "want", "reason", "tip_on"),
    [
        (((B, 30_000), (C, 60_000)), set(), C, Reason.PLACED_RESIDENT, ()),  # where most of its own context is
        (((B, 30_000), (C, 60_000)), {C}, B, Reason.PLACED_RESIDENT, ()),  # a retry: not where it failed
        (((C, 60_000),), set(), C, Reason.PLACED_RESIDENT, ()),  # though B is idler
        (((C, 9_000),), set(), B, Reason.PLACED_NEW, ()),  # under a tenth of 100k: a cold prefill anywhere
        (((A, 60_000),), set(), B, Reason.PLACED_NEW, ()),  # A over the hard bound (9 in flight, bound 8)
        (((D, 60_000),), set(), B, Reason.PLACED_NEW, ()),  # D draining: no session binds there
        # an incomplete mirror holds its last stored block (depth unknown): all of it is there
        ((), set(), C, Reason.PLACED_RESIDENT, (C,)),
        ((), set(), C, Reason.PLACED_RESIDENT, (A, C)),  # A over the hard bound
        ((), set(), B, Reason.PLACED_RESIDENT, (C, B)),  # the least loaded of two
        ((), {C}, B, Reason.PLACED_NEW, (C,)),  # a retry: not where it failed
        ((), set(), B, Reason.PLACED_NEW, (D,)),  # draining
        (((B, 30_000),), set(), B, Reason.PLACED_RESIDENT, (C,)),  # a known amount goes first
        (((B, 5_000),), set(), C, Reason.PLACED_RESIDENT, (C,)),  # a known tenth does not: the tip does
    ],
)
def test_a_session_without_a_home_goes_back_to_where_the_events_show_its_cache(
    resident_on: tuple[tuple[str, int], ...], excluded: set[str], want: str, reason: Reason, tip_on: tuple[str, ...]
) -> None:
    """A session the store does not know (its binding expired, or the gateway restarted on embedded
    state) but whose blocks the engines' KV events name: rule 6 sends it to its cache, under the
    same conditions as any home; otherwise it is placed by load (B, the idlest)."""
    sess = dataclasses.replace(session("s1", None, ctx=0, turns=0), resident_on=resident_on, tip_on=tip_on)
    snap = snapshot(replica(A, in_flight=9), replica(B), replica(C, in_flight=2), replica(D, status=S.DRAINING), sess=sess)
    d = KvAwarePolicy().route(request(prompt=100_000, excluded=excluded), snap, random.Random(0))
    assert (d.replica_id, d.reason) == (want, reason)
    assert d.effects == (bind(want, None, reason),)

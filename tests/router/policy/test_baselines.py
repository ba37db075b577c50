"""Baselines: exact picks on hand-built snapshots, and the seed's uniform-hashing sketch."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.errors import NoReplicaError
from router.model import Reason, ReplicaStatus
from router.policy.baselines import HashPolicy, LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from router.policy.hashing import hrw_rank, hrw_slot, hrw_top
from tests.builders import fleet, replica, request, snapshot

S = ReplicaStatus


@pytest.mark.parametrize(("seq", "expected"), [(0, "a"), (1, "c"), (2, "a"), (5, "c")])
def test_round_robin_uses_seq_and_skips_ineligible(seq: int, expected: str) -> None:
    snap = snapshot(
        replica("a"), replica("b", status=S.DRAINING), replica("c"), replica("d", status=S.DOWN), seq=seq
    )
    d = RoundRobinPolicy().route(request(), snap, random.Random(0))
    assert (d.replica_id, d.reason, d.effects) == (expected, Reason.ROUND_ROBIN, ())


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ({"a": (3, 0), "b": (1, 5), "c": (1, 2)}, "c"),  # in-flight first, then queue
        ({"a": (0, 9), "b": (1, 0), "c": (2, 0)}, "a"),
    ],
)
def test_least_loaded(loads: dict[str, tuple[int, int]], expected: str) -> None:
    snap = snapshot(*(replica(r, in_flight=f, queued=q) for r, (f, q) in loads.items()))
    d = LeastLoadedPolicy().route(request(), snap, random.Random(0))
    assert (d.replica_id, d.reason) == (expected, Reason.LEAST_LOADED)


def test_least_loaded_ignores_affinity_and_excluded() -> None:
    snap = snapshot(replica("a"), replica("b", in_flight=1), replica("c", in_flight=4))
    assert LeastLoadedPolicy().route(request(excluded={"a"}), snap, random.Random(0)).replica_id == "b"


def test_random_is_seeded_and_eligible_only() -> None:
    snap = snapshot(replica("a"), replica("b", status=S.JOINING), replica("c"), replica("d"))
    picks = [
        RandomPolicy().route(request(excluded={"d"}), snap, random.Random(s)).replica_id for s in range(200)
    ]
    assert set(picks) == {"a", "c"}
    assert picks == [
        RandomPolicy().route(request(excluded={"d"}), snap, random.Random(s)).replica_id for s in range(200)
    ]


def test_hash_is_the_rendezvous_winner_and_sticky() -> None:
    snap = snapshot(*fleet(10))
    ids = [r.id for r in snap.replicas]
    for i in range(50):
        d = HashPolicy().route(request(f"s{i}"), snap, random.Random(i))
        assert (d.replica_id, d.reason, d.effects) == (hrw_top(f"s{i}", ids), Reason.HASH, ())


def test_hash_failover_goes_to_next_rank() -> None:
    snap = snapshot(*fleet(10))
    rank = hrw_rank("sess", [r.id for r in snap.replicas])
    d = HashPolicy().route(request("sess", excluded={rank[0]}), snap, random.Random(0))
    assert d.replica_id == rank[1]


def test_hash_without_key_is_random() -> None:
    snap = snapshot(*fleet(10))
    picks = {HashPolicy().route(request(None), snap, random.Random(s)).replica_id for s in range(100)}
    assert len(picks) > 5


@pytest.mark.parametrize("policy", [RandomPolicy(), RoundRobinPolicy(), LeastLoadedPolicy(), HashPolicy()])
def test_no_eligible_replica_raises(policy: object) -> None:
    snap = snapshot(replica("a", status=S.DOWN), replica("b", status=S.DRAINING), replica("c"))
    with pytest.raises(NoReplicaError):
        policy.route(request(excluded={"c"}), snap, random.Random(0))  # type: ignore[attr-defined]


def test_uniform_hashing_matches_the_seed_sketch() -> None:
    """The seed's sketch: uniform hashing, 50 replicas, 250 sessions -> P(≤1) ≈ 4 %, P(≥12) ≈ 0.5 %.

    Exact Binomial(250, 1/50) values: P(≤1) = 0.0391, P(≥12) = 0.0050. Over 300 runs there are
    15,000 replica samples; the standard error of the pooled fractions is ≈ sqrt(p(1-p)/15000),
    0.0016 and 0.0006, so ±0.008 and ±0.003 are five standard errors (flaky only if the hash is not
    uniform). Session ids differ per run so each run is an independent draw.
    """
    n_rep, n_sess, runs = 50, 250, 300
    snap = snapshot(*fleet(n_rep))
    ids = [r.id for r in snap.replicas]
    le1 = ge12 = 0
    policy = HashPolicy()
    for run in range(runs):
        counts = Counter(
            policy.route(request(f"run{run}-sess{i}"), snap, random.Random(0)).replica_id
            for i in range(n_sess)
        )
        per = [counts.get(r, 0) for r in ids]
        le1 += sum(1 for c in per if c <= 1)
        ge12 += sum(1 for c in per if c >= 12)
    samples = n_rep * runs
    assert abs(le1 / samples - 0.0391) < 0.008
    assert abs(ge12 / samples - 0.0050) < 0.003


def test_sticky_least_loaded_binds_new_sessions_to_the_least_loaded_and_keeps_them() -> None:
    from router.model import BindSession
    from router.policy.baselines import StickyLeastLoadedPolicy
    from tests.builders import session

    pol = StickyLeastLoadedPolicy()
    fresh = snapshot(replica("a", in_flight=3), replica("b", in_flight=1), replica("c", in_flight=2))
    d = pol.route(request(), fresh, random.Random(0))
    assert (d.replica_id, d.reason, d.effects) == (
        "b",
        Reason.PLACED_NEW,
        (BindSession("s1", "b", None, Reason.PLACED_NEW),),
    )
    # bound to a: stays there however busy it is, while it is ACTIVE
    bound = snapshot(replica("a", in_flight=9), replica("b"), sess=session("s1", "a"))
    d = pol.route(request(), bound, random.Random(0))
    assert (d.replica_id, d.reason, d.effects) == ("a", Reason.AFFINITY, ())
    # its home gone: rebound (compare-and-set on the old home) to the least loaded
    gone = snapshot(
        replica("a", status=S.DOWN), replica("b", in_flight=2), replica("c"), sess=session("s1", "a")
    )
    d = pol.route(request(), gone, random.Random(0))
    assert (d.replica_id, d.reason) == ("c", Reason.REASSIGNED_GONE)
    assert d.effects == (BindSession("s1", "c", "a", Reason.REASSIGNED_GONE),)
    # no key: least loaded, nothing bound
    d = pol.route(request(None), fresh, random.Random(0))
    assert (d.replica_id, d.reason, d.effects) == ("b", Reason.LEAST_LOADED, ())


def test_hrw_slot_is_the_rendezvous_winner_among_numbered_slots() -> None:
    slots = ["0", "1", "2", "3"]
    assert [hrw_slot(f"s{i}", 4) for i in range(50)] == [int(str(hrw_top(f"s{i}", slots))) for i in range(50)]
    assert {hrw_slot(f"s{i}", 1) for i in range(20)} == {0}
    counts = Counter(hrw_slot(f"s{i}", 4) for i in range(4000))
    assert all(900 < counts[k] < 1100 for k in range(4)), counts
    # a fifth slot takes only the keys it now wins
    moved = [i for i in range(1000) if hrw_slot(f"s{i}", 4) != hrw_slot(f"s{i}", 5)]
    assert moved and all(hrw_slot(f"s{i}", 5) == 4 for i in moved)

"""Rule 8 (queue spill): a warm turn stuck behind a long prefill queue at home goes elsewhere, this
request only, onto a replica whose host tier has room for it; and the ledger that feeds it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from router.model import AffinityBreak, BindSession, ClusterSnapshot, Reason, ReplicaState
from router.policy.kv_aware import KvAwarePolicy
from router.policy.params import PolicyParams
from router.policy.prefill import PrefillLedger, expected_uncached, work_ahead
from tests.builders import replica, request, session, snapshot

HOST = 1_700_000
CTX = 100_000
PROMPT = 101_000  # the session's next turn: its context + 1k new tokens


def _fleet(*, ahead: dict[str, int], host: int = HOST, resident_on: tuple[tuple[str, int], ...] = (),
           **changes: ReplicaState) -> ClusterSnapshot:  # fmt: skip
    reps = {rid: replica(rid, host=host) for rid in ("a", "b", "c")}
    reps.update(changes)
    sess = dataclasses.replace(session("s1", "a", ctx=CTX), resident_on=resident_on)
    snap = snapshot(*reps.values(), sess=sess)
    return dataclasses.replace(snap, prefill_ahead={r: t for r, t in ahead.items() if t})


def _route(snap: ClusterSnapshot, **params: float) -> tuple[str, Reason]:
    policy = KvAwarePolicy(PolicyParams().with_changes(**params))
    d = policy.route(request("s1", prompt=PROMPT), snap, random.Random(1))
    return d.replica_id, d.reason


def test_a_warm_turn_behind_a_long_queue_goes_to_the_cheapest_other_replica_for_this_request_only() -> None:
    # home: 250k uncached tokens ahead + the turn's own 1k; b: 50k ahead + the whole prompt cold; c: idle
    snap = _fleet(ahead={"a": 250_000, "b": 50_000})
    d = KvAwarePolicy().route(request("s1", prompt=PROMPT), snap, random.Random(1))
    assert (d.replica_id, d.reason) == ("c", Reason.QUEUE_SPILL)
    assert not any(isinstance(e, BindSession) for e in d.effects)  # the session stays bound at home
    assert d.expected_break is AffinityBreak.OVERLOAD_SPILL  # its cache there is knowingly not used


@pytest.mark.parametrize(
    ("ahead_at_home", "factor", "where"),
    [
        (250_000, 2.0, "c"),  # 251k > 2 x 101k
        (150_000, 2.0, "a"),  # 151k: not twice a cold start elsewhere
        (250_000, 3.0, "a"),  # 251k < 3 x 101k
        (250_000, 0.0, "a"),  # the rule off
        (0, 2.0, "a"),  # nothing ahead at home
    ],
)
def test_the_turn_leaves_only_when_home_costs_more_than_the_factor_times_elsewhere(
    ahead_at_home: int, factor: float, where: str
) -> None:
    snap = _fleet(ahead={"a": ahead_at_home, "b": 50_000})
    assert _route(snap, queue_spill_factor=factor)[0] == where


def test_only_onto_a_host_tier_with_room_for_the_prompt() -> None:
    # no host tier anywhere (a KV-bound fleet): the cold prompt would evict others' caches
    assert _route(_fleet(ahead={"a": 400_000}, host=0)) == ("a", Reason.AFFINITY)
    # c's host tier is full, b's has room: b, though c is the idle one
    full = replica("c", host=HOST)
    full = dataclasses.replace(full, engine=dataclasses.replace(full.engine, host_used_tokens=HOST - PROMPT + 1))
    assert _route(_fleet(ahead={"a": 400_000, "b": 10_000}, c=full)) == ("b", Reason.QUEUE_SPILL)


def test_never_onto_a_replica_at_the_hard_bound() -> None:
    busy = replica("c", host=HOST, in_flight=8)  # hard_bound_min: the bound of an idle fleet
    assert _route(_fleet(ahead={"a": 400_000, "b": 10_000}, c=busy)) == ("b", Reason.QUEUE_SPILL)


def test_what_is_resident_elsewhere_makes_that_replica_cheaper() -> None:
    # b holds 90k of the session already (events): 11k to compute there, against c's 101k
    snap = _fleet(ahead={"a": 250_000, "b": 30_000}, resident_on=(("a", CTX), ("b", 90_000)))
    assert _route(snap) == ("b", Reason.QUEUE_SPILL)


def test_expected_uncached_is_the_prompt_less_what_is_cached_there() -> None:
    snap = _fleet(ahead={}, resident_on=(("a", CTX), ("b", 60_000)))
    req = request("s1", prompt=PROMPT)
    assert expected_uncached(req, snap, "a") == PROMPT - CTX  # home: its context is cached
    assert expected_uncached(req, snap, "b") == PROMPT - 60_000
    assert expected_uncached(req, snap, "c") == PROMPT
    assert expected_uncached(request("other", prompt=5_000), snap, "a") == 5_000  # not this session
    small = request("s1", prompt=40_000)  # a sub-agent's shorter prompt: never negative
    assert expected_uncached(small, snap, "a") == 0


def _queued(rid: str, tokens: int) -> ReplicaState:
    r = replica(rid, host=HOST)
    return dataclasses.replace(r, engine=dataclasses.replace(r.engine, waiting_uncached_tokens=tokens))


def test_with_other_gateways_the_engines_queue_moves_a_turn_this_gateways_ledger_does_not_see() -> None:
    # another gateway queued 250k at home (the engine reports it) and 50k on b; this one sent nothing
    snap = _fleet(ahead={}, a=_queued("a", 250_000), b=_queued("b", 50_000))
    assert _route(PrefillLedger().with_ahead(snap)) == ("a", Reason.AFFINITY)  # alone: its ledger only
    assert _route(PrefillLedger().with_ahead(snap, others=True)) == ("c", Reason.QUEUE_SPILL)


def test_a_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="queue_spill_factor"):
        PolicyParams().with_changes(queue_spill_factor=0.5)
    assert PolicyParams().with_changes(queue_spill_factor=1).queue_spill_factor == 1.0


def test_the_ledger_sums_each_replicas_prefill_until_the_first_token() -> None:
    ledger = PrefillLedger()
    ledger.sent("l1", "b", 30_000)
    ledger.sent("l2", "a", 100_000)
    ledger.sent("l3", "b", 5_000)
    ledger.sent("l4", "a", 0)  # all cached: nothing ahead of anyone
    assert ledger.ahead() == {"a": 100_000, "b": 35_000}
    ledger.prefilled("l1")
    ledger.prefilled("l1")  # the first token, then the release: once
    ledger.prefilled("l4")
    assert ledger.ahead() == {"a": 100_000, "b": 5_000}
    ledger.prefilled("l2")
    ledger.prefilled("l3")
    assert ledger.ahead() == {} and len(ledger) == 0


def test_the_target_is_the_cheapest_replica_then_the_lowest_id_on_any_fleet() -> None:
    """Against a scan of every replica (the rule stops at the first one at the floor no replica can go
    under): random work ahead, residency and host room on twelve replicas, 200 fleets."""
    for seed in range(200):
        _check_cheapest_target(seed)


def _check_cheapest_target(seed: int) -> None:
    rng = random.Random(seed)
    ids = [f"r{i:02d}" for i in range(12)]
    reps = [replica(rid, host=rng.choice((HOST, HOST, 0))) for rid in ids]
    resident = tuple((rid, rng.choice((30_000, CTX))) for rid in ids[1:] if rng.random() < 0.2)
    sess = dataclasses.replace(session("s1", "r00", ctx=CTX), resident_on=resident)
    ahead = {rid: rng.choice((0, 0, 20_000, 60_000, 150_000)) for rid in ids[1:]}
    ahead["r00"] = rng.choice((150_000, 250_000, 400_000))
    snap = dataclasses.replace(
        snapshot(*reps, sess=sess), prefill_ahead={r: t for r, t in ahead.items() if t}
    )
    req = request("s1", prompt=PROMPT)
    d = KvAwarePolicy().route(req, snap, random.Random(1))

    def cost(r: ReplicaState) -> int:
        return work_ahead(snap, r) + expected_uncached(req, snap, r.id)

    home = snap.replica("r00")
    assert home is not None
    floor = PROMPT - max((t for _, t in resident), default=0)
    eligible = [r for r in snap.replicas if r.id != "r00" and r.host_capacity_tokens >= PROMPT]
    best = min(eligible, key=lambda r: (cost(r), r.id), default=None)
    spills = best is not None and cost(home) > 2.0 * max(floor, cost(best))
    want = (best.id, Reason.QUEUE_SPILL) if spills and best else ("r00", Reason.AFFINITY)
    assert (d.replica_id, d.reason) == want, f"fleet {seed}"


@pytest.mark.parametrize("seed", range(5))
def test_the_ledgers_view_is_every_replicas_sum_through_any_order_of_events(seed: int) -> None:
    """Against the sums of the requests still without a first token, after each of 2,000 random sends
    and first tokens; a view handed out earlier does not change with the ledger."""
    rng = random.Random(seed)
    ledger, open_ = PrefillLedger(), {}
    held: list[tuple[object, dict[str, int]]] = []
    for i in range(2_000):
        if open_ and rng.random() < 0.5:
            lease = rng.choice(sorted(open_))
            del open_[lease]
            ledger.prefilled(lease)
        else:
            lease, rid, tokens = f"l{i}", f"r{rng.randrange(40):02d}", rng.choice((0, 1, 500, 30_000))
            ledger.sent(lease, rid, tokens)
            if tokens:
                open_[lease] = (rid, tokens)
        want: dict[str, int] = {}
        for rid, tokens in open_.values():
            want[rid] = want.get(rid, 0) + tokens
        assert ledger.ahead() == want, i
        assert len(ledger) == len(open_)
        if i % 100 == 0:
            held.append((ledger.ahead(), dict(want)))
    assert all(view == then for view, then in held)


def test_with_other_gateways_work_ahead_is_the_larger_of_the_ledger_and_the_engines_queue() -> None:
    """Another gateway's requests are not in this gateway's ledger, only in the engine's own report
    of its queued uncached prefill: with others, each replica's work ahead is the larger of the two
    (a replica this gateway sent nothing to included); alone, the ledger's alone."""
    ledger = PrefillLedger()
    ledger.sent("l1", "a", 30_000)
    ledger.sent("l2", "b", 5_000)
    reps = []
    for rid, queued in (("a", 10_000), ("b", 40_000), ("c", 70_000), ("d", 0)):
        r = replica(rid)
        reps.append(dataclasses.replace(r, engine=dataclasses.replace(r.engine, waiting_uncached_tokens=queued)))
    snap = snapshot(*reps)
    mine = ledger.with_ahead(snap)
    assert mine.prefill_ahead == {"a": 30_000, "b": 5_000} and not mine.engines_ahead
    assert [work_ahead(mine, r) for r in mine.replicas] == [30_000, 5_000, 0, 0]
    shared = ledger.with_ahead(snap, others=True)
    assert shared.prefill_ahead == mine.prefill_ahead and shared.engines_ahead
    assert [work_ahead(shared, r) for r in shared.replicas] == [30_000, 40_000, 70_000, 0]
    alone = snapshot(replica("d"))
    assert PrefillLedger().with_ahead(alone) is alone
    # no request of this gateway's own in flight: the engines' queues still count
    queued = snapshot(*reps)
    assert [work_ahead(PrefillLedger().with_ahead(queued, others=True), r) for r in queued.replicas] == [
        10_000, 40_000, 70_000, 0
    ]

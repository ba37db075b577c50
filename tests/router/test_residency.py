"""The residency index (router/residency.py): stores, evictions, tiers, completeness, bounds."""

from __future__ import annotations

import pytest

from router.residency import ESTIMATE, EVENTS, OFF, ReplicaResidency, ResidencyIndex, merged_source

GPU, CPU = 1, 2


def chain(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def complete(**kw: int) -> ReplicaResidency:
    r = ReplicaResidency(**kw)
    r.cleared()  # an empty cache we know all of
    return r


def test_a_session_store_from_the_root_is_exact() -> None:
    r = complete()
    r.stored(None, chain(100, 4), 16, 64, GPU, "s1")
    assert r.resident_tokens("s1") == 64
    # the next turn continues below the tip: a partial last page counts its tokens only
    r.stored(103, chain(200, 3), 16, 40, GPU, "s1")
    assert r.resident_tokens("s1") == 64 + 40
    assert r.resident_blocks == 7


def test_tail_eviction_moves_the_tip_up_and_full_eviction_is_zero() -> None:
    r = complete()
    r.stored(None, chain(100, 4), 16, 64, GPU, "s1")
    r.stored(103, chain(200, 2), 16, 32, GPU, "s1")
    r.removed([200, 201], GPU)  # leaf first, as a radix cache evicts
    assert r.resident_tokens("s1") == 64
    r.removed([102, 103], GPU)  # the tail of the first run (a split node)
    assert r.resident_tokens("s1") == 32
    r.removed([100, 101], GPU)
    assert r.resident_tokens("s1") == 0
    assert r.resident_blocks == 0


def test_removal_lists_in_forward_order_within_one_event() -> None:
    # SGLang lists a node's pages first to last, and coalesces consecutive removals into one event
    r = complete()
    r.stored(None, chain(1, 3), 1, 3, GPU, "a")
    r.stored(3, chain(10, 3), 1, 3, GPU, "b")
    r.removed([10, 11, 12, 2, 3], GPU)
    assert r.resident_tokens("a") == 1
    assert r.resident_tokens("b") == 0  # b's tip is a's first block now: none of b's own is left


def test_shared_prefix_sessions_each_keep_their_own_tip() -> None:
    r = complete()
    r.stored(None, chain(1, 4), 16, 64, GPU, "a")  # system prompt, stored by a
    r.stored(4, chain(10, 2), 16, 32, GPU, "a")
    r.stored(4, chain(20, 5), 16, 80, GPU, "b")  # b matched a's prompt and stored its own part
    assert r.resident_tokens("a") == 96
    assert r.resident_tokens("b") == 80  # its own part: the 64 shared tokens it found are not its own
    r.removed([20, 21, 22, 23, 24], GPU)
    assert (r.resident_tokens("a"), r.resident_tokens("b")) == (96, 0)


def test_a_session_owns_what_it_stored_beyond_what_it_found_cached() -> None:
    r = complete()
    r.stored(None, chain(1, 4), 16, 64, GPU, "first")  # the shared prompt, stored by the first session
    r.stored(4, chain(10, 4), 16, 64, GPU, "s")  # s found 64 tokens cached and stored 64 of its own
    r.stored(13, chain(20, 2), 16, 32, GPU, "s")  # its next turn continues below its own tip
    assert r.resident_tokens("s") == 96
    r.removed([20, 21, 10, 11, 12, 13], GPU)  # all of s's own blocks evicted; the shared prompt stays
    assert r.resident_tokens("s") == 0
    assert r.resident_tokens("first") == 64  # the first session stored the shared prompt: it is its own
    # s comes back and re-stores from the shared prompt: what it found is still not its own
    r.stored(4, chain(30, 2), 16, 32, GPU, "s")
    assert r.resident_tokens("s") == 32
    # a store from higher up (as if the shared prompt had been gone and s stored it again): from now on
    # all of what s holds counts as its own (its tip stays the deeper run)
    r.stored(None, chain(40, 3), 16, 48, GPU, "s")
    assert r.bases["s"] == 0
    assert r.resident_tokens("s") == 96


def test_a_shorter_conversation_of_the_session_does_not_move_its_tip() -> None:
    r = complete()
    r.stored(None, chain(1, 2), 16, 32, GPU, "other")  # the shared prompt
    r.stored(2, chain(10, 6), 16, 96, GPU, "s")  # the parent's context: 96 of its own
    r.stored(2, chain(30, 2), 16, 32, GPU, "s")  # a sub-agent of s (same session id), shorter
    assert r.resident_tokens("s") == 96  # still the parent's: the session is not evicted
    r.removed([14, 15], GPU)  # the parent's tail goes: its tip moves up its own chain
    assert r.resident_tokens("s") == 64
    r.stored(2, chain(40, 3), 16, 48, GPU, "s")  # a store shallower than the tip: the tip stays
    assert r.resident_tokens("s") == 64
    r.removed([10, 11, 12, 13], GPU)  # the parent's context is gone; the tip goes to the shared prompt
    assert r.resident_tokens("s") == 0
    r.stored(2, chain(50, 2), 16, 32, GPU, "s")  # a store deeper than what is left is the tip again
    assert r.resident_tokens("s") == 32


def test_an_unknown_parent_counts_what_was_found_as_own() -> None:
    r = ReplicaResidency()  # incomplete: joined mid-stream
    r.stored(None, chain(1, 2), 16, 32, GPU, "a")
    r.stored(999, chain(10, 2), 16, 32, GPU, "b")  # below a block we never saw: unknown end
    assert r.resident_tokens("b") is None
    assert r.bases["b"] == 0  # if its end were learnt, nothing of it would be taken as shared


def test_a_dropped_or_reset_session_forgets_its_base() -> None:
    r = complete(max_sessions=1)
    r.stored(None, chain(1, 4), 16, 64, GPU, "a")
    r.stored(4, chain(10, 1), 16, 16, GPU, "b")  # b's entry pushes a's out (the session bound)
    assert "a" not in r.bases and r.bases["b"] == 64
    r.reset_incomplete()
    assert r.bases == {}


def test_a_block_stays_while_any_tier_holds_it() -> None:
    r = complete()
    r.stored(None, chain(1, 2), 16, 32, GPU, "s")
    r.stored(None, chain(1, 2), 16, 32, CPU, None)  # written through to host
    r.removed([1, 2], GPU)
    assert r.resident_tokens("s") == 32  # still on host
    r.removed([2], CPU)
    assert r.resident_tokens("s") == 16


def test_untracked_sessions_read_zero_only_when_complete() -> None:
    r = ReplicaResidency()
    assert r.resident_tokens("nobody") is None
    r.cleared()
    assert r.resident_tokens("nobody") == 0


def test_a_parent_we_never_saw_makes_the_answer_unknown() -> None:
    r = ReplicaResidency()  # incomplete: joined late
    r.stored(999, chain(1, 2), 16, 32, GPU, "late")
    assert r.resident_tokens("late") is None
    r.stored(None, chain(50, 2), 16, 32, GPU, "fresh")  # stored from the root after we joined
    assert r.resident_tokens("fresh") == 32
    assert r.unknown_parents == 1


def test_eviction_into_an_unknown_ancestor_is_unknown() -> None:
    r = ReplicaResidency()
    r.stored(999, chain(1, 2), 16, 32, GPU, "s")
    r.removed([1, 2], GPU)
    assert r.resident_tokens("s") is None


def test_a_resident_tip_of_unknown_depth_names_its_replica() -> None:
    """Rule 7: the session stored below a block we never saw (its chain began before the replay);
    its tokens are unknown, but while its last block is resident all of its context is."""
    idx = ResidencyIndex()
    a, b, c = idx.replica("a"), idx.replica("b"), idx.replica("c")
    c.cleared()
    a.stored(999, chain(1, 2), 16, 32, GPU, "s")  # incomplete: joined after the session began
    b.stored(None, chain(50, 2), 16, 32, GPU, "s")  # stored from the root after we joined: exact
    c.stored(None, chain(60, 2), 16, 32, GPU, "t")
    assert a.tip_resident("s") and not b.tip_resident("s") and not c.tip_resident("t")
    assert idx.resident_tokens("a", "s") is None
    assert idx.resident_on("s") == (("b", 32),) and idx.tip_on("s") == ("a",)
    assert idx.tip_on("t") == () and idx.tip_on("nobody") == ()
    a.stored(2, chain(3, 1), 16, 16, GPU, "s")  # its next turn, below its tip: still unknown depth
    assert idx.tip_on("s") == ("a",)
    a.stale = True  # disconnected: it may have changed unseen
    assert idx.tip_on("s") == ()
    a.stale = False
    a.removed([3, 2, 1], GPU)  # evicted up into what we never saw: nothing is known
    assert idx.tip_on("s") == () and idx.resident_tokens("a", "s") is None


def test_clear_zeroes_every_session_and_makes_it_complete() -> None:
    r = ReplicaResidency()
    r.stored(None, chain(1, 2), 16, 32, GPU, "s")
    r.cleared()
    assert r.complete and r.resident_tokens("s") == 0 and r.resident_blocks == 0


def test_reset_incomplete_forgets_everything() -> None:
    r = complete()
    r.stored(None, chain(1, 2), 16, 32, GPU, "s")
    r.reset_incomplete()
    assert not r.complete and r.resident_tokens("s") is None and r.resident_blocks == 0
    # the session stays known (rule 8): the next complete point makes it an exact 0, not untracked
    assert r.tracks("s") and r.sessions == 1
    r.cleared()
    assert r.tracks("s") and r.resident_tokens("s") == 0


def test_stale_mirror_answers_none() -> None:
    r = complete()
    r.stored(None, chain(1, 2), 16, 32, GPU, "s")
    r.stale = True
    assert r.resident_tokens("s") is None


def test_block_bound_drops_the_mirror() -> None:
    r = complete(max_blocks=5)
    r.stored(None, chain(1, 4), 16, 64, GPU, "s")
    assert r.complete
    r.stored(4, chain(10, 2), 16, 32, GPU, "s")
    assert not r.complete and r.overflows == 1 and r.resident_blocks == 0
    assert r.resident_tokens("s") is None


def test_session_bound_drops_the_least_recently_changed() -> None:
    r = complete(max_sessions=2)
    r.stored(None, [1], 16, 16, GPU, "a")
    r.stored(None, [2], 16, 16, GPU, "b")
    r.stored(1, [3], 16, 16, GPU, "a")  # a changed last
    r.stored(None, [4], 16, 16, GPU, "c")  # b is dropped
    assert r.sessions == 2
    assert r.resident_tokens("a") == 32 and r.resident_tokens("c") == 16
    assert r.resident_tokens("b") == 0  # complete: untracked reads 0
    # a dropped session leaves no dangling tip: evicting its block changes nobody
    r.removed([2], GPU)
    assert r.sessions == 2


def test_a_shallower_store_keeps_the_session_recent() -> None:
    r = complete(max_sessions=2)
    r.stored(None, chain(1, 4), 16, 64, GPU, "a")
    r.stored(None, [10], 16, 16, GPU, "b")
    r.stored(None, [1, 20], 16, 32, GPU, "a")  # a's sub-agent: shallower, the tip stays, a is recent
    r.stored(None, [30], 16, 16, GPU, "c")  # b is the least recently changed: dropped
    assert r.resident_tokens("a") == 64 and r.resident_tokens("c") == 16
    assert r.resident_tokens("b") == 0 and r.sessions == 2


def test_changes_are_tracked_for_a_writer() -> None:
    r = ReplicaResidency(track_changes=True)
    r.cleared()
    r.stored(None, chain(1, 2), 16, 32, GPU, "s")
    r.stored(None, [9], 16, 16, GPU, "t")
    reset, items = r.take_changes()
    assert not reset and sorted(items) == [("s", 32), ("t", 16)]
    r.removed([2], GPU)
    assert r.take_changes() == (False, [("s", 16)])
    r.reset_incomplete()
    assert r.take_changes() == (True, [])
    assert r.take_changes() == (False, [])


def test_index_merges_ranks_and_reports_sources() -> None:
    idx = ResidencyIndex()
    a0 = idx.replica("a", 0, 2)
    a1 = idx.replica("a", 1, 2)
    b = idx.replica("b")
    for r in (a0, a1, b):
        r.cleared()
    a1.stored(None, chain(1, 3), 16, 48, GPU, "s")
    b.stored(None, chain(1, 1), 16, 16, GPU, "s")
    assert idx.resident_tokens("a", "s") == 48  # the rank holding it
    assert idx.resident_on("s") == (("a", 48), ("b", 16))
    assert idx.resident_tokens("zzz", "s") is None
    assert (idx.source("a"), idx.source("b"), idx.source("zzz")) == (EVENTS, EVENTS, OFF)
    a1.reset_incomplete()
    assert idx.source("a") == ESTIMATE
    assert idx.resident_tokens("a", "s") is None  # rank 0 is complete and has none; rank 1 unknown
    a0.stored(None, [7], 16, 16, GPU, "s")
    assert idx.resident_tokens("a", "s") == 16  # known to hold at least this
    b.stale = True
    assert idx.source("b") == ESTIMATE
    idx.drop("a")
    assert idx.source("a") == OFF
    assert idx.stats()["b"]["blocks"] == 1


@pytest.mark.parametrize(
    ("sources", "want"),
    [((), OFF), ((EVENTS, EVENTS), EVENTS), ((EVENTS, ESTIMATE), ESTIMATE), ((OFF, EVENTS), EVENTS)],
)
def test_merged_source(sources: tuple[str, ...], want: str) -> None:
    assert merged_source(sources) == want


def test_a_data_parallel_replica_sends_a_session_to_the_rank_holding_its_cache() -> None:
    from router.policy.hashing import hrw_slot

    idx = ResidencyIndex()
    assert idx.rank_for("r", "s") is None  # not mirrored: the caller hashes
    one = idx.replica("solo")
    one.cleared()
    assert idx.rank_for("solo", "s") is None  # one rank: nothing to choose
    r0, r1 = idx.replica("r", 0, 2), idx.replica("r", 1, 2)
    assert idx.rank_for("r", "s") is None  # neither rank is complete yet: unknown
    r0.cleared()
    r1.cleared()
    # an idle engine: the session's rendezvous rank, as a gateway without events would pick
    assert [idx.rank_for("r", f"s{i}") for i in range(20)] == [hrw_slot(f"s{i}", 2) for i in range(20)]
    r0.stored(None, chain(1, 4), 16, 64, GPU, "a")
    assert idx.rank_for("r", "a") == 0  # its cache
    assert idx.rank_for("r", "new") == 1  # the rank holding less
    r1.stored(None, chain(10, 6), 16, 96, GPU, "b")
    assert (idx.rank_for("r", "a"), idx.rank_for("r", "b"), idx.rank_for("r", "new")) == (0, 1, 0)
    # a session cached on neither rank goes to the one with fewer requests in flight first, whatever
    # each holds (a full cache is mostly idle sessions' prefixes, evicted as needed); the session's
    # own cache still wins over a busy rank
    assert idx.rank_for("r", "new", busy=[2, 1]) == 1 and idx.rank_for("r", "new", busy=[1, 2]) == 0
    assert idx.rank_for("r", "new", busy=[1, 1]) == 0  # equally busy: the rank holding less
    assert idx.rank_for("r", "a", busy=[5, 0]) == 0 and idx.rank_for("r", "b", busy=[0, 5]) == 1
    r0.removed(chain(1, 4), GPU)  # a's cache is gone: placed where there is room
    assert idx.rank_for("r", "a") == 0 and r0.resident_tokens("a") == 0
    assert idx.rank_for("r", "a", busy=[1, 0]) == 1
    r1.stale = True  # a rank whose subscriber is disconnected: unknown, hashed by the caller
    assert idx.rank_for("r", "a") is None


def test_a_turn_whose_stores_have_not_arrived_is_unknown_not_gone() -> None:
    """Rule 8: a session's next turn can come before the events of its last one. A session that
    finished a turn on its home (``residency_mark`` > 0) with no entry there reads ``None`` (the
    estimate decides), so it is not moved as evicted; an exact 0 after its blocks went stays 0."""
    from router.model import SessionState
    from router.residency import with_residency

    idx = ResidencyIndex()
    r = idx.replica("a")
    r.cleared()
    r.stored(None, [1], 16, 16, GPU, "other")
    finished = SessionState("s1", home="a", context_tokens=48, residency_mark=100)
    placed = SessionState("s1", home="a", context_tokens=48)  # bound, no turn finished there yet
    assert idx.resident_tokens("a", "s1") == 0 and not idx.tracks("a", "s1")
    assert with_residency(finished, idx).resident_tokens is None
    assert with_residency(placed, idx).resident_tokens == 0
    r.stored(None, [5, 6, 7], 16, 48, GPU, "s1")  # the events arrive
    assert idx.tracks("a", "s1") and with_residency(finished, idx).resident_tokens == 48
    r.removed([5, 6, 7], GPU)  # evicted: the tip became an exact 0, still tracked
    assert idx.tracks("a", "s1") and with_residency(finished, idx).resident_tokens == 0
    r.stale = True  # a disconnected subscriber tracks nobody
    assert not idx.tracks("a", "s1") and with_residency(finished, idx).resident_tokens is None

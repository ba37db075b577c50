"""Rule 6 feedback: was a response an *affinity break*, and why?

A response is a break when the engine's cached tokens fall short of what the session had already
sent (its previous context) by more than a partial page. The reason comes from how the request was
routed (``Lease.reason``), whether the store overrode the decision (``Lease.disagreement``) and where
the session key came from.
"""

from __future__ import annotations

from router.model import AffinityBreak, Completion, KeySource, Lease, Reason

__all__ = ["classify_break", "continues_context", "found_resident", "home_found"]

CONTINUES_FRACTION = 0.95
"""A request *continues* its session's context when its prompt is at least this fraction of it. The
parent chain's next turn carries the whole context (a little less when the engine strips the last
turn's reasoning); a sub-agent's turn or a rewritten (compacted) history is a new, smaller prompt
whose low cache hit says nothing about eviction."""


def continues_context(prev_context_tokens: int, prompt_tokens: int) -> bool:
    return prev_context_tokens > 0 and prompt_tokens >= CONTINUES_FRACTION * prev_context_tokens


def found_resident(
    prev_context_tokens: int,
    prompt_tokens: int,
    cached_tokens: int,
    *,
    expected_tokens: int | None = None,
    page_tokens: int = 64,
    rel_tolerance: float = 0.02,
) -> bool | None:
    """Engine feedback on residency (rule 6): was the session's previous context (or, given
    ``expected_tokens``, that much of it) still cached where this request ran? ``None`` when the
    request does not continue that context (no evidence)."""
    if not continues_context(prev_context_tokens, prompt_tokens):
        return None
    want = prev_context_tokens if expected_tokens is None else expected_tokens
    expected = min(want, prompt_tokens)
    return cached_tokens >= expected - (page_tokens + rel_tolerance * expected)


def home_found(
    lease: Lease, completion: Completion, *, resident_tokens: int | None = None, page_tokens: int = 64
) -> bool | None:
    """Did a request sent home for its cache (``Reason.AFFINITY``) find there what the residency its
    decision went by promised? The estimate promises the whole previous context; exact residency
    promises the session's own ``resident_tokens`` it saw (which may be a part: a session stays home
    while a tenth is left), so a miss then means the events were wrong or the cache went while the
    request queued. ``None`` when there is nothing to judge: another reason, a home another gateway
    chose, a failed request, no cached tokens reported, or a prompt that does not continue the
    session's context."""
    if lease.reason is not Reason.AFFINITY or lease.disagreement or not completion.ok:
        return None
    if completion.prompt_tokens is None or completion.cached_tokens is None:
        return None
    return found_resident(
        lease.prev_context_tokens,
        completion.prompt_tokens,
        completion.cached_tokens,
        expected_tokens=resident_tokens,
        page_tokens=page_tokens,
    )


_BY_REASON: dict[Reason, AffinityBreak] = {
    Reason.THICC_SPLIT: AffinityBreak.THICC_SPLIT,
    Reason.REASSIGNED_OVERLOAD: AffinityBreak.OVERLOAD_SPILL,
    Reason.QUEUE_SPILL: AffinityBreak.OVERLOAD_SPILL,
    Reason.REASSIGNED_DRAINING: AffinityBreak.REPLICA_GONE,
    Reason.REASSIGNED_GONE: AffinityBreak.REPLICA_GONE,
    Reason.RETRY: AffinityBreak.REPLICA_GONE,
    Reason.PLACED_EVICTED: AffinityBreak.EVICTED,
    # baselines without affinity spread load instead of following the cache
    Reason.RANDOM: AffinityBreak.OVERLOAD_SPILL,
    Reason.ROUND_ROBIN: AffinityBreak.OVERLOAD_SPILL,
    Reason.LEAST_LOADED: AffinityBreak.OVERLOAD_SPILL,
}


def classify_break(
    lease: Lease,
    completion: Completion,
    key_source: KeySource,
    *,
    page_tokens: int = 64,
    rel_tolerance: float = 0.02,
) -> AffinityBreak | None:
    """The break's reason, or ``None`` when the cache was (close enough to) fully reused.

    Only a request that continues the session's context (``continues_context``) is judged; its
    expected reuse is ``min(prev_context_tokens, prompt_tokens)``. Tolerance: one partial page
    (``page_tokens``) plus ``rel_tolerance`` of the expectation, for re-tokenised or stripped
    reasoning at the tail. Nothing is classified when the request failed, the engine did not report
    cached tokens, or the session had no previous context.
    """
    if not completion.ok or completion.prompt_tokens is None or completion.cached_tokens is None:
        return None
    resident = found_resident(
        lease.prev_context_tokens,
        completion.prompt_tokens,
        completion.cached_tokens,
        page_tokens=page_tokens,
        rel_tolerance=rel_tolerance,
    )
    if resident is None or resident:
        return None
    if lease.disagreement:  # another gateway bound the session elsewhere first
        return AffinityBreak.GATEWAY_DISAGREEMENT
    by_reason = _BY_REASON.get(lease.reason)
    if by_reason is not None:
        return by_reason
    if not key_source.named:
        return AffinityBreak.NO_SESSION_ID
    return AffinityBreak.EVICTED  # routed to where the cache should have been: the engine evicted it

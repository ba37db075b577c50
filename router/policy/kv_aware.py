"""``kv_aware``: session affinity with load-aware, working-set-aware, bounded-load placement.

DESIGN.md §3 rules, applied in this order for a request of a known session (docs/POLICY.md):

  gone      home removed / DOWN / JOINING              -> reassign now (REASSIGNED_GONE)
  retry     home in ``request.excluded``               -> overflow or placement, no rebind (RETRY)
  draining  home DRAINING and session idle             -> reassign (REASSIGNED_DRAINING)
  chain     the request's conversation last ran on another replica of the session, which may take
            it (pool, hard bound, max_overflow)        -> there (THICC_SPLIT, no break expected)
  evicted   session idle and its cache surely gone     -> place afresh by load (PLACED_EVICTED)
  thicc     ≥ thicc_threshold in flight at home (a request that does not continue the session's
            context), or home overloaded mid-turn     -> sticky overflow replica (THICC_SPLIT)
  overload  session idle and home overloaded           -> reassign to a replica under the bound
                                                          (REASSIGNED_OVERLOAD)
  spill     home's prefill work ahead + this prompt's uncached part > queue_spill_factor x the
            same on another replica whose host tier has room for the prompt
                                                       -> there, this request only (QUEUE_SPILL)
  affinity  otherwise                                  -> home (AFFINITY); idle overflows collapse

"Overloaded": over the hard bound (in-flight requests) and KV-bound (its sessions' working set
exceeds its HBM + host tier). Below the bound, or where the working set fits, a warm session stays.

A warm session is never moved for load otherwise: the move's cold prefill (seconds for a
coding session's context) lands on one request and stalls the target's others, which costs more at
the tail than the busier home (docs/POLICY.md, "Load moves").

New sessions (and prefix-keyed requests, rule 7) are placed by expected delay among ACTIVE replicas,
filtered by the hard bound, the bounded-load session cap and the fresh-replica ramp cap (each filter
is dropped if it would leave nobody), ties (scores closer than half a session's weight) going to the rendezvous winner
of the session id. Everything is a pure function of (request, snapshot, rng).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from router.errors import NoReplicaError
from router.model import (
    AffinityBreak,
    BindSession,
    ClusterSnapshot,
    Effect,
    Reason,
    ReplicaId,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
    SetOverflow,
)
from router.policy.breaks import continues_context
from router.policy.hashing import hrw_weight
from router.policy.params import PolicyParams
from router.policy.prefill import expected_uncached, work_ahead

__all__ = [
    "BOUNDED_LOAD_EPSILON",
    "KV_AWARE",
    "RAMP_CAP_FACTOR",
    "KvAwarePolicy",
    "cache_surely_gone",
    "estimate_gone",
    "exact_gone",
    "kv_bound",
    "load_score",
    "load_scores",
    "residency_horizon",
]

KV_AWARE = "kv_aware"

_GONE = frozenset({ReplicaStatus.DOWN, ReplicaStatus.JOINING})

BOUNDED_LOAD_EPSILON = 0.25
"""Rule 3's session cap: no replica takes a new session while it holds ≥ ceil((1+ε)·mean) active
sessions (consistent hashing with bounded loads). A constant: no value measured changed a result
outside the seed spread, with one gateway or ten lagged ones (docs/POLICY.md rounds 16 and 29)."""

RAMP_CAP_FACTOR = 1.5
"""Rule 4's ramp: a fresh replica takes at most this × its fair share of the placements in the
store's ramp window (``ReplicaState.placed_recent``), and at least one. A constant: 0.01 and 100
gave the default's runs to the last digit on four scale-ups with ten lagged gateways (docs/POLICY.md
round 29)."""


def hbm_capacity(replica: ReplicaState, params: PolicyParams) -> int:
    """The store fills ``capacity_tokens`` by one precedence rule (``router.model.capacities``)."""
    return replica.capacity_tokens or params.default_capacity_tokens


def total_capacity(replica: ReplicaState, params: PolicyParams) -> int:
    """HBM + host tier (HiCache): what LRU eviction is measured against."""
    return hbm_capacity(replica, params) + replica.host_capacity_tokens


def residency_horizon(replica: ReplicaState, params: PolicyParams) -> float:
    """Tokens a replica may write after a session's last turn before that session's cache is gone:
    what the engine's own answers showed (``residency_horizon_tokens``, rule 6 feedback), else its
    whole cache (HBM + host: an LRU drops what is older than its capacity)."""
    return float(replica.residency_horizon_tokens or total_capacity(replica, params))


def kv_bound(replica: ReplicaState, params: PolicyParams) -> bool:
    """Does the working set bound here (contexts of its sessions seen within the active window)
    exceed the replica's whole KV, HBM + host tier? Then it evicts its own sessions' caches, and
    rule 1's hard bound applies to them."""
    return replica.active_context_tokens > total_capacity(replica, params)


def estimate_gone(session: SessionState, home: ReplicaState, params: PolicyParams) -> bool:
    """Rule 6's estimate: has the home written more than its residency horizon since this session?

    A residency mark of 0 means the session has not finished a turn on this home yet: unknown,
    so assume resident (never move a session because of missing information).
    """
    if session.residency_mark <= 0:
        return False
    written_since = home.tokens_written - session.residency_mark
    return written_since > residency_horizon(home, params)


def exact_gone(session: SessionState) -> bool | None:
    """Rule 6 from the engine's KV events: is less than a tenth of the session's context still
    resident on its home as its own (``SessionState.resident_tokens``: beyond the shared prefix it
    found cached there, which the other replicas hold too)? Then its next turn is a cold prefill of
    its own context wherever it runs, and it is placed afresh. A session with more left stays: moving
    it would throw that part away (at half, the moves cost more hit rate than they won,
    docs/KV_EVENTS.md). ``None``: no exact knowledge."""
    if session.resident_tokens is None:
        return None
    return session.resident_tokens < 0.1 * session.context_tokens


def cache_surely_gone(session: SessionState, home: ReplicaState, params: PolicyParams) -> bool:
    """Rule 6: exact residency when the engine publishes it, else the estimate."""
    exact = exact_gone(session)
    return estimate_gone(session, home, params) if exact is None else exact


def load_score(replica: ReplicaState, context_tokens: int, params: PolicyParams) -> float:
    """Expected delay of one more session of ``context_tokens`` here, in requests-in-flight units.

    Requests in flight (all gateways; others' as of the store's last refresh) + the active sessions
    bound here (closed-loop sessions come back: ``w_sessions`` each) + a penalty once the working set with this session exceeds
    ``working_set_limit`` of HBM (where a replica starts evicting its own sessions).
    """
    ws = (replica.active_context_tokens + max(0, context_tokens)) / hbm_capacity(replica, params)
    return (
        replica.in_flight
        + params.w_sessions * replica.sessions_active
        + params.w_working_set * max(0.0, ws - params.working_set_limit)
    )


def load_scores(replicas: Sequence[ReplicaState], context_tokens: int, params: PolicyParams) -> list[float]:
    """``load_score`` of each replica, in one pass (the same expression, so the same floats)."""
    ctx = max(0, context_tokens)
    default_cap = params.default_capacity_tokens
    w_sessions, w_ws, limit = params.w_sessions, params.w_working_set, params.working_set_limit
    return [
        r.in_flight
        + w_sessions * r.sessions_active
        + w_ws * max(0.0, (r.active_context_tokens + ctx) / (r.capacity_tokens or default_cap) - limit)
        for r in replicas
    ]


class _View:
    """Per-request fleet figures derived once from the snapshot. The candidate pool is built only
    when a placement needs it; the counts and sums come from the store's running totals when the
    snapshot has them (``ClusterSnapshot.totals``), so a request that stays home costs O(1)."""

    __slots__ = (
        "_excluded",
        "_pool",
        "_pool_is_active",
        "_replicas",
        "hard_bound",
        "mean_in_flight",
        "panic",
        "ramp_share",
        "serving_since",
        "session_cap",
    )

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        excluded: frozenset[ReplicaId],
        *,
        panic: bool,
        pool_is_active: bool,
        mean_in_flight: float,
        hard_bound: float,
        session_cap: int,
        ramp_share: int,
    ) -> None:
        self._replicas = snapshot.replicas
        self._excluded = excluded
        self._pool: tuple[ReplicaState, ...] | None = None
        self._pool_is_active = pool_is_active  # the pool is the ACTIVE replicas, else all live ones
        self.panic = panic
        self.mean_in_flight = mean_in_flight  # over ACTIVE replicas
        self.hard_bound = hard_bound
        self.session_cap = session_cap
        self.ramp_share = ramp_share
        self.serving_since = snapshot.serving_since  # replicas ACTIVE since before it are the initial fleet

    def in_pool(self, r: ReplicaState) -> bool:
        """May this request go to ``r`` (never excluded/DOWN/JOINING)?"""
        if r.id in self._excluded:
            return False
        return r.status is ReplicaStatus.ACTIVE if self._pool_is_active else r.status not in _GONE

    @property
    def pool(self) -> tuple[ReplicaState, ...]:
        """The replicas this request may go to, in id order."""
        if self._pool is None:
            ex, reps = self._excluded, self._replicas
            if self._pool_is_active:
                pool = [r for r in reps if r.status is ReplicaStatus.ACTIVE]
            else:
                pool = [r for r in reps if r.status not in _GONE]
            self._pool = tuple(r for r in pool if r.id not in ex) if ex else tuple(pool)
        return self._pool


class KvAwarePolicy:
    name = KV_AWARE

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params or PolicyParams()

    # ---- entry -----------------------------------------------------------------------------------

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        d = self._route(request, snapshot, rng)
        sess = snapshot.session
        if request.session_key is None or sess is None or sess.session_id != request.session_key or sess.home is None:
            return d
        home = snapshot.replica(sess.home)
        if home is None:
            return d
        # which residency decided (the break accounting reports it), and whether the estimate would
        # have agreed with the engine's own account where that is known
        exact = exact_gone(sess)
        if exact is None:
            return dataclasses.replace(d, residency="estimate")
        est = estimate_gone(sess, home, self.params)
        check = "agree" if est == exact else ("false_gone" if est else "false_resident")
        return dataclasses.replace(d, residency="events", estimate_check=check)

    def _route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        view = self._view(request, snapshot)
        sid = request.session_key
        sess = snapshot.session
        if sid is None:
            target, scores = self._place(
                view,
                request,
                snapshot,
                rng,
                key=None,
                ctx=request.prompt_tokens_estimate,
                avoid=frozenset(),
                binding=False,
            )
            return RouteDecision(target.id, Reason.PLACED_NEW, (), scores)
        if sess is None or sess.session_id != sid or sess.home is None:
            own = sess if sess is not None and sess.session_id == sid else None
            ctx = (own.context_tokens if own is not None else 0) or request.prompt_tokens_estimate
            if own is not None and (own.resident_on or own.tip_on):
                back = self._back_to_cache(view, snapshot, own, ctx)
                if back is not None:
                    return back
            target, scores = self._place(
                view,
                request,
                snapshot,
                rng,
                key=sid,
                ctx=ctx,
                avoid=frozenset(),
                binding=True,
            )
            bind = BindSession(sid, target.id, only_if=None, reason=Reason.PLACED_NEW)
            return RouteDecision(target.id, Reason.PLACED_NEW, (bind,), scores)
        return self._route_known(view, request, snapshot, sess, rng)

    # ---- known session -----------------------------------------------------------------------------

    def _route_known(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        sess: SessionState,
        rng: random.Random,
    ) -> RouteDecision:
        p = self.params
        sid = sess.session_id
        old_home = sess.home
        assert old_home is not None
        home = snapshot.replica(old_home)
        idle = sess.in_flight_total == 0
        ctx = sess.context_tokens or request.prompt_tokens_estimate

        if home is None or home.status in _GONE:
            return self._move(
                view,
                request,
                snapshot,
                sess,
                rng,
                Reason.REASSIGNED_GONE,
                AffinityBreak.REPLICA_GONE,
                avoid=frozenset({old_home}),
            )
        if home.id in request.excluded:
            return self._spill(
                view, request, snapshot, sess, home, rng, Reason.RETRY, AffinityBreak.REPLICA_GONE
            )
        if home.status is ReplicaStatus.DRAINING and idle and not view.panic:
            moved = self._try_move(
                view,
                request,
                snapshot,
                sess,
                rng,
                Reason.REASSIGNED_DRAINING,
                AffinityBreak.REPLICA_GONE,
                avoid=frozenset({old_home}),
            )
            if moved is not None:
                return moved  # else: nowhere else to go, the draining home serves it
        at = sess.chain_at(request.chain_key)
        if at is not None and at != home.id:
            # rule 2: a conversation that last ran on an overflow replica (a sub-agent split off a
            # thicc session) continues there, where its own context is cached
            followed = self._follow_chain(view, snapshot, sess, at)
            if followed is not None:
                return followed
        if idle and cache_surely_gone(sess, home, p):
            target, scores = self._place(
                view, request, snapshot, rng, key=sid, ctx=ctx, avoid=frozenset(), binding=True
            )
            effects = self._collapse(sess, keep_only=())
            if target.id != old_home:
                effects = (
                    BindSession(sid, target.id, only_if=old_home, reason=Reason.PLACED_EVICTED),
                    *effects,
                )
            return RouteDecision(target.id, Reason.PLACED_EVICTED, effects, scores, AffinityBreak.EVICTED)

        # rule 1's bound yields a warm cache only at a KV-bound home: where the working set fits,
        # the turn is warm at home and waits seconds, while a move re-prefills its whole context
        # and queues the target as long (docs/POLICY.md round 25)
        overloaded = home.in_flight >= view.hard_bound and not view.panic and kv_bound(home, p)
        # the parent chain's next turn carries the whole session context: its cache is at home
        extends = continues_context(sess.context_tokens, request.prompt_tokens_estimate)
        thicc = sess.in_flight_at(home.id) >= p.thicc_threshold
        if (thicc and not extends) or (overloaded and not idle):
            brk = AffinityBreak.OVERLOAD_SPILL if overloaded else AffinityBreak.THICC_SPLIT
            return self._spill(view, request, snapshot, sess, home, rng, Reason.THICC_SPLIT, brk)
        if idle and overloaded:
            # rule 1: the bound is hard; the session leaves for a replica under it, if there is one
            decision = self._try_move(
                view,
                request,
                snapshot,
                sess,
                rng,
                Reason.REASSIGNED_OVERLOAD,
                AffinityBreak.OVERLOAD_SPILL,
                avoid=frozenset({old_home}),
            )
            if decision is not None and self._relieves(decision, snapshot, view):
                return decision
        kept = self._collapse(sess, keep_only=tuple(o for o in sess.overflow if sess.in_flight_at(o) > 0))
        spilled = self._queue_spill(view, request, snapshot, home, kept)
        if spilled is not None:
            return spilled
        return RouteDecision(home.id, Reason.AFFINITY, kept, ((home.id, load_score(home, 0, p)),))

    def _queue_spill(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        home: ReplicaState,
        kept: tuple[Effect, ...],
    ) -> RouteDecision | None:
        """Rule 8: a warm turn whose home has far more prefill work ahead of it than its cold start
        would cost elsewhere goes there, this request only (the session stays bound; where its
        conversation ran is remembered, as for any request). Cost on a replica = the prefill work
        ahead there (``work_ahead``: the ledger, with other gateways at least the engine's queue) + this
        prompt's tokens not cached there.
        Only onto a replica whose host tier has room for the whole prompt, so that what the prompt
        displaces from HBM is demoted, not lost (on a KV-bound fleet a cold prompt evicts another
        session's cache: docs/POLICY.md round 37), and that is under the hard bound."""
        theta = self.params.queue_spill_factor
        prompt = request.prompt_tokens_estimate
        if theta <= 0 or prompt <= 0 or not (snapshot.prefill_ahead or snapshot.engines_ahead):
            return None
        at_home = work_ahead(snapshot, home)
        if at_home <= 0:
            return None
        cost_home = at_home + expected_uncached(request, snapshot, home.id)
        resident = snapshot.session.resident_on if snapshot.session is not None else ()
        # no replica can cost less than the prompt less the most of it cached anywhere else
        floor = prompt - max((t for r, t in resident if r != home.id), default=0)
        if cost_home <= theta * floor:
            return None
        best: tuple[int, ReplicaId, ReplicaState] | None = None
        for r in view.pool:
            if r.id == home.id or r.status is not ReplicaStatus.ACTIVE:
                continue
            if not view.panic and r.in_flight >= view.hard_bound:
                continue
            if r.host_capacity_tokens - r.engine.host_used_tokens < prompt:
                continue
            cost = work_ahead(snapshot, r) + expected_uncached(request, snapshot, r.id)
            # equal costs go to the lowest id on purpose: spills then fill a few replicas first. The
            # least loaded of them, or a spread by the session's hash, measured worse on the tail
            # (docs/POLICY.md round 39)
            if best is None or (cost, r.id) < best[:2]:
                best = (cost, r.id, r)
                if cost <= floor:  # the pool is in id order and none costs less: the rest cannot win
                    break
        if best is None or cost_home <= theta * best[0]:
            return None
        target = best[2]
        score = load_score(target, 0, self.params)
        return RouteDecision(
            target.id, Reason.QUEUE_SPILL, kept, ((target.id, score),), AffinityBreak.OVERLOAD_SPILL
        )

    def _back_to_cache(
        self, view: _View, snapshot: ClusterSnapshot, sess: SessionState, ctx: int
    ) -> RouteDecision | None:
        """Rule 6 for a session without a home whose cache the engines' KV events show resident (its
        binding expired, or the gateway restarted on embedded state): it is bound where most of its
        own context is, if that is at least a tenth of it (less is a cold prefill anywhere, as
        ``exact_gone`` says) and the replica may take it (ACTIVE, in the pool, under the hard bound).
        Failing that, where an incomplete mirror holds its last stored block (``tip_on``: all of
        its context up to that block is there), the least loaded such replica."""

        def may_take(rid: ReplicaId) -> ReplicaState | None:
            r = snapshot.replica(rid)
            if r is None or r.status is not ReplicaStatus.ACTIVE or not view.in_pool(r):
                return None
            return r if view.panic or r.in_flight < view.hard_bound else None

        best: tuple[ReplicaState, int] | None = None
        for rid, tokens in sess.resident_on:
            r = may_take(rid) if tokens >= 0.1 * ctx else None
            if r is not None and (best is None or tokens > best[1]):
                best = (r, tokens)
        if best is None:
            tips = [r for r in map(may_take, sess.tip_on) if r is not None]
            if not tips:
                return None
            best = (min(tips, key=lambda r: (r.in_flight, r.id)), 0)
        target = best[0]
        bind = BindSession(sess.session_id, target.id, only_if=None, reason=Reason.PLACED_RESIDENT)
        score = load_score(target, ctx, self.params)
        return RouteDecision(target.id, Reason.PLACED_RESIDENT, (bind,), ((target.id, score),))

    def _follow_chain(
        self, view: _View, snapshot: ClusterSnapshot, sess: SessionState, at: ReplicaId
    ) -> RouteDecision | None:
        """The request's conversation last ran on ``at`` (not home): go there if it may take it
        (in the pool, under the hard bound) and the session may span it (``max_overflow``)."""
        p = self.params
        r = snapshot.replica(at)
        if r is None or not view.in_pool(r) or (not view.panic and r.in_flight >= view.hard_bound):
            return None
        effects: tuple[Effect, ...] = ()
        if at not in sess.overflow:
            if len(sess.overflow) >= p.max_overflow:
                return None
            effects = (SetOverflow(sess.session_id, (*sess.overflow, at)),)
        return RouteDecision(at, Reason.THICC_SPLIT, effects, ((at, load_score(r, 0, p)),))

    @staticmethod
    def _relieves(decision: RouteDecision, snapshot: ClusterSnapshot, view: _View) -> bool:
        """A move off an over-the-bound home only helps if the target is under the bound."""
        target = snapshot.replica(decision.replica_id)
        return target is not None and target.in_flight + 1 < view.hard_bound

    # ---- moves, spills, placement ---------------------------------------------------------------

    def _move(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        sess: SessionState,
        rng: random.Random,
        reason: Reason,
        brk: AffinityBreak,
        avoid: frozenset[ReplicaId],
    ) -> RouteDecision:
        """Rebind the session elsewhere (compare-and-set on its current home)."""
        ctx = sess.context_tokens or request.prompt_tokens_estimate
        target, scores = self._place(
            view, request, snapshot, rng, key=sess.session_id, ctx=ctx, avoid=avoid, binding=True
        )
        bind = BindSession(sess.session_id, target.id, only_if=sess.home, reason=reason)
        overflow = tuple(o for o in sess.overflow if o != target.id and sess.in_flight_at(o) > 0)
        effects: tuple[Effect, ...] = (bind, *self._collapse(sess, keep_only=overflow))
        return RouteDecision(target.id, reason, effects, scores, brk)

    def _try_move(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        sess: SessionState,
        rng: random.Random,
        reason: Reason,
        brk: AffinityBreak,
        avoid: frozenset[ReplicaId],
    ) -> RouteDecision | None:
        """Like ``_move`` but ``None`` when there is nowhere else to go (the caller stays home)."""
        try:
            return self._move(view, request, snapshot, sess, rng, reason, brk, avoid)
        except NoReplicaError:
            return None

    def _spill(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        sess: SessionState,
        home: ReplicaState,
        rng: random.Random,
        reason: Reason,
        brk: AffinityBreak,
    ) -> RouteDecision:
        """Rule 2: send this request to a sticky overflow replica; grow the set only when needed."""
        p = self.params
        keep = _usable_overflows(view, snapshot, sess, home)
        target: ReplicaState | None = None
        fresh_pick = False
        scores: tuple[tuple[ReplicaId, float], ...] = ()
        for r in keep:
            if sess.in_flight_at(r.id) < p.thicc_threshold:
                target = r
                break
        grow = reason is not Reason.RETRY  # a retry is a one-off: it does not create a sticky overflow
        if target is None and (len(keep) < p.max_overflow or not grow):
            avoid = frozenset({home.id, *(r.id for r in keep)})
            try:
                target, scores = self._place(
                    view,
                    request,
                    snapshot,
                    rng,
                    key=sess.session_id,
                    ctx=sess.context_tokens or request.prompt_tokens_estimate,
                    avoid=avoid,
                    binding=False,
                )
                fresh_pick = True
                if grow:
                    keep.append(target)
            except NoReplicaError:
                target = None
        if target is None:
            options = list(keep)
            if home.id not in request.excluded and home.status is not ReplicaStatus.DOWN:
                options.append(home)
            if not options:
                raise NoReplicaError(f"no replica can take a request of session {sess.session_id!r}")
            target = min(options, key=lambda r: (sess.in_flight_at(r.id), r.in_flight, r.id))
        new_overflow = tuple(r.id for r in keep)
        effects: tuple[Effect, ...] = ()
        if new_overflow != sess.overflow:
            effects = (SetOverflow(sess.session_id, new_overflow),)
        if target.id == home.id:
            return RouteDecision(home.id, Reason.AFFINITY, effects, scores)
        if not scores:
            scores = ((target.id, load_score(target, 0, p)),)
        expected = brk if (fresh_pick or reason is Reason.RETRY) else None
        return RouteDecision(target.id, reason, effects, scores, expected)

    @staticmethod
    def _collapse(sess: SessionState, keep_only: tuple[ReplicaId, ...]) -> tuple[Effect, ...]:
        if keep_only == sess.overflow:
            return ()
        return (SetOverflow(sess.session_id, keep_only),)

    def _place(
        self,
        view: _View,
        request: RouteRequest,
        snapshot: ClusterSnapshot,
        rng: random.Random,
        key: str | None,
        ctx: int,
        avoid: frozenset[ReplicaId],
        binding: bool,
    ) -> tuple[ReplicaState, tuple[tuple[ReplicaId, float], ...]]:
        """Rule 3/4: the replica with the least expected delay among those passing the filters.

        ``binding``: the pick becomes the session's home (session cap and ramp cap apply). A session
        re-homed for its own reason (cache gone, home overloaded, draining or down) may go to a
        replica that joined by scale-up like anywhere else: it moves whether or not one joined
        (docs/POLICY.md round 29).
        """
        p = self.params
        # each filter is dropped if it would leave nobody (``[...] or cands``); written out inline
        # because a placement visits every replica (thousands in a large simulated fleet)
        cands = [r for r in view.pool if r.id not in avoid] if avoid else list(view.pool)
        if binding and not view.panic:
            # new sessions never go to a draining replica
            cands = [r for r in cands if r.status is ReplicaStatus.ACTIVE] or cands
        if not cands:
            raise NoReplicaError("no eligible replica")
        if not view.panic:
            hard = view.hard_bound
            cands = [r for r in cands if r.in_flight < hard] or cands
            if binding:
                since, now = view.serving_since, snapshot.now
                cap = view.session_cap
                cands = [r for r in cands if r.sessions_active < cap] or cands
                if since is not None:
                    # fresh (joined by scale-up, i.e. ACTIVE after the store started routing: the
                    # initial fleet turns ACTIVE one by one in the first health round, before
                    # ``since``, less than fresh_window_s ago): only up to the ramp share (rule 4)
                    fresh_s, share = p.fresh_window_s, view.ramp_share
                    cands = [
                        r
                        for r in cands
                        if not (r.joined_at > since and now - r.joined_at < fresh_s) or r.placed_recent < share
                    ] or cands
        scores = load_scores(cands, ctx, p)
        best = min(scores)
        ties = [r for r, s in zip(cands, scores, strict=True) if s < best + 0.5 * p.w_sessions or s == best]
        if len(ties) == 1:
            target = ties[0]
        elif key is not None:
            target = max(ties, key=lambda r: (hrw_weight(key, r.id), r.id))
        else:
            # equal-score replicas only: break with the injected rng (deterministic per seed)
            best_ties = [r for r, s in zip(cands, scores, strict=True) if s == best]
            target = best_ties[rng.randrange(len(best_ties))]
        return target, tuple(zip([r.id for r in cands], scores, strict=True))

    def _view(self, request: RouteRequest, snapshot: ClusterSnapshot) -> _View:
        p = self.params
        excluded = request.excluded
        t = snapshot.totals
        if t is not None and not excluded and t.active > 0:
            n_active, n_live, n_counted = t.active, t.replicas - t.down - t.joining, t.replicas - t.joining
            fleet_in_flight, fleet_sessions, fleet_recent = t.active_in_flight, t.active_sessions, t.active_placed_recent
            n = t.active
        else:
            live = [r for r in snapshot.replicas if r.id not in excluded and r.status not in _GONE]
            n_live = len(live)
            n_active = sum(1 for r in live if r.status is ReplicaStatus.ACTIVE)
            # a JOINING replica has never served: a scale-up that more than doubles the fleet is no panic
            n_counted = sum(1 for r in snapshot.replicas if r.id not in excluded and r.status is not ReplicaStatus.JOINING)
            panic = n_active < p.panic_threshold * n_counted
            pool_n = n_live if panic or not n_active else n_active
            if not pool_n:
                raise NoReplicaError("no replica is ACTIVE or DRAINING outside the excluded set")
            # no ACTIVE replica at all: the pool (then every live one) stands in
            fleet = [r for r in snapshot.replicas if r.status is ReplicaStatus.ACTIVE] or live
            fleet_in_flight = sum(r.in_flight for r in fleet)
            fleet_sessions = sum(r.sessions_active for r in fleet)
            fleet_recent = sum(r.placed_recent for r in fleet)
            n = len(fleet)
        panic = n_active < p.panic_threshold * n_counted
        mean = fleet_in_flight / n
        hard = max(float(p.hard_bound_min), p.hard_bound_factor * mean)
        sessions = max(snapshot.sessions_active, fleet_sessions)
        cap = math.ceil((1.0 + BOUNDED_LOAD_EPSILON) * (sessions + 1) / n)
        share = max(1, math.ceil(RAMP_CAP_FACTOR * (fleet_recent + 1) / n))
        return _View(
            snapshot,
            excluded,
            panic=panic,
            pool_is_active=not panic and n_active > 0,
            mean_in_flight=mean,
            hard_bound=hard,
            session_cap=cap,
            ramp_share=share,
        )


def _usable_overflows(
    view: _View, snapshot: ClusterSnapshot, sess: SessionState, home: ReplicaState
) -> list[ReplicaState]:
    """The session's overflow replicas that may still serve it: in the pool, not home, and under
    the hard bound (unless in panic), in the session's order."""
    out: list[ReplicaState] = []
    for oid in sess.overflow:
        r = snapshot.replica(oid)
        if (
            r is not None
            and view.in_pool(r)
            and r.id != home.id
            and (view.panic or r.in_flight < view.hard_bound)
        ):
            out.append(r)
    return out

"""Baseline policies shipped for comparison in every benchmark (DESIGN §3, last paragraph).

All skip excluded, JOINING, DOWN and DRAINING replicas, and raise ``NoReplicaError`` when nothing is
left. Same signature as ``kv_aware``. Only ``sticky_least_loaded`` binds sessions (the sticky
policy the peer routers ship: vllm-router's ``sticky_least_loaded``, sglang-router's ``manual`` with
``min_load``); the others keep no affinity state.
"""

from __future__ import annotations

import random

from router.errors import NoReplicaError
from router.model import (
    BindSession,
    ClusterSnapshot,
    Reason,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
)
from router.policy.hashing import HrwTopCache

__all__ = [
    "HASH",
    "LEAST_LOADED",
    "RANDOM",
    "ROUND_ROBIN",
    "STICKY_LEAST_LOADED",
    "HashPolicy",
    "LeastLoadedPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "StickyLeastLoadedPolicy",
    "eligible",
]

RANDOM = "random"
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
HASH = "hash"
STICKY_LEAST_LOADED = "sticky_least_loaded"


def eligible(request: RouteRequest, snapshot: ClusterSnapshot) -> list[ReplicaState]:
    """ACTIVE replicas not excluded for this request, in id order; ``NoReplicaError`` if none."""
    out = [r for r in snapshot.replicas if r.status is ReplicaStatus.ACTIVE and r.id not in request.excluded]
    if not out:
        raise NoReplicaError("no ACTIVE replica outside the excluded set")
    return out


class RandomPolicy:
    name = RANDOM

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        cands = eligible(request, snapshot)
        return RouteDecision(cands[rng.randrange(len(cands))].id, Reason.RANDOM)


class RoundRobinPolicy:
    """Cursor = the store's request counter ``snapshot.seq`` (shared by every gateway on one store)."""

    name = ROUND_ROBIN

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        cands = eligible(request, snapshot)
        return RouteDecision(cands[snapshot.seq % len(cands)].id, Reason.ROUND_ROBIN)


class LeastLoadedPolicy:
    """Fewest in flight, then shortest engine queue; remaining ties broken by the rng."""

    name = LEAST_LOADED

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        cands = eligible(request, snapshot)
        best = min((r.in_flight, r.engine.queued) for r in cands)
        ties = [r for r in cands if (r.in_flight, r.engine.queued) == best]
        scores = tuple((r.id, float(r.in_flight)) for r in cands)
        return RouteDecision(ties[rng.randrange(len(ties))].id, Reason.LEAST_LOADED, (), scores)


class HashPolicy:
    """Stateless session affinity: the rendezvous (mmh3) winner among ACTIVE replicas.

    A replica joining takes only the keys it now wins; one leaving gives up only its own. Requests
    without a key go to a random replica.
    """

    name = HASH

    def __init__(self) -> None:
        self._tops = HrwTopCache()  # a memo: decisions are those of ``hrw_top``

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        t, positions = snapshot.totals, snapshot.positions
        if (
            request.session_key is not None
            and not request.excluded
            and t is not None
            and positions is not None
            and 0 < t.active == t.replicas
        ):
            # every replica is eligible: the candidate set is the snapshot's index, no scan
            top = self._tops.top(request.session_key, positions)
        else:
            cands = eligible(request, snapshot)
            if request.session_key is None:
                return RouteDecision(cands[rng.randrange(len(cands))].id, Reason.HASH)
            top = self._tops.top(request.session_key, tuple(r.id for r in cands))
        assert top is not None
        return RouteDecision(top, Reason.HASH)


class StickyLeastLoadedPolicy:
    """A session stays on its home while the home is ACTIVE; a new session (or one whose home is
    gone) binds to the replica with the fewest requests in flight, ties broken by the rng."""

    name = STICKY_LEAST_LOADED

    def route(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision:
        cands = eligible(request, snapshot)
        sess = snapshot.session
        home = sess.home if sess is not None and sess.session_id == request.session_key else None
        if home is not None and any(r.id == home for r in cands):
            return RouteDecision(home, Reason.AFFINITY)
        least = min(r.in_flight for r in cands)
        ties = [r for r in cands if r.in_flight == least]
        target = ties[rng.randrange(len(ties))].id
        if request.session_key is None:
            return RouteDecision(target, Reason.LEAST_LOADED)
        reason = Reason.PLACED_NEW if home is None else Reason.REASSIGNED_GONE
        return RouteDecision(target, reason, (BindSession(request.session_key, target, home, reason),))

"""Hypothesis strategies shared by property tests (attrs ``tests/strategies.py`` style)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from router.model import (
    ClusterSnapshot,
    KeySource,
    ReplicaState,
    ReplicaStatus,
    RouteRequest,
    SessionState,
)
from router.policy.params import PolicyParams
from tests.builders import replica, session, snapshot

__all__ = ["Scenario", "policy_params", "replica_states", "scenarios", "session_ids"]

session_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=24)

statuses = st.sampled_from(list(ReplicaStatus))


@st.composite
def replica_states(
    draw: st.DrawFn, rid: str, status: st.SearchStrategy[ReplicaStatus] = statuses
) -> ReplicaState:
    return replica(
        rid,
        status=draw(status),
        in_flight=draw(st.integers(0, 20)),
        queued=draw(st.integers(0, 6)),
        kv_util=draw(st.floats(0.0, 1.0)),
        sessions=draw(st.integers(0, 15)),
        active_ctx=draw(st.integers(0, 3_000_000)),
        written=draw(st.integers(0, 10_000_000)),
        capacity=draw(st.sampled_from([0, 400_000, 850_000])),
        host=draw(st.sampled_from([0, 1_700_000])),
        placed=draw(st.integers(0, 6)),
        joined_at=draw(st.sampled_from([0.0, 0.0, 500.0, 950.0])),
        engine_updated_at=draw(st.sampled_from([0.0, 1.0])),
    )


@st.composite
def policy_params(draw: st.DrawFn) -> PolicyParams:
    return PolicyParams().with_changes(
        thicc_threshold=draw(st.integers(1, 5)),
        max_overflow=draw(st.integers(0, 3)),
        hard_bound_min=draw(st.integers(1, 12)),
        panic_threshold=draw(st.floats(0.0, 1.0)),
        w_sessions=draw(st.floats(0.0, 1.0)),
    )


@dataclass(frozen=True)
class Scenario:
    snap: ClusterSnapshot
    req: RouteRequest


@st.composite
def scenarios(draw: st.DrawFn, min_replicas: int = 0, max_replicas: int = 10) -> Scenario:
    n = draw(st.integers(min_replicas, max_replicas))
    ids = [f"r{i:02d}" for i in range(n)]
    reps = [draw(replica_states(rid)) for rid in ids]
    key = draw(st.one_of(st.none(), session_ids))
    sess: SessionState | None = None
    if key is not None and draw(st.booleans()):
        home = draw(st.sampled_from([*ids, "gone", None])) if ids else draw(st.sampled_from(["gone", None]))
        pool = [i for i in ids if i != home]
        overflow = tuple(draw(st.lists(st.sampled_from(pool), unique=True, max_size=3))) if pool else ()
        places = [x for x in [home, *overflow] if x is not None]
        in_flight = {r: draw(st.integers(0, 6)) for r in places}
        sess = session(
            key,
            home,
            overflow=overflow,
            in_flight=in_flight,
            ctx=draw(st.integers(0, 400_000)),
            mark=draw(st.integers(0, 9_000_000)),
        )
    excluded = (
        frozenset(draw(st.lists(st.sampled_from(ids), unique=True, max_size=n))) if ids else frozenset()
    )
    source = KeySource.NONE if key is None else draw(st.sampled_from([KeySource.HEADER, KeySource.PREFIX]))
    req = RouteRequest(
        session_key=key,
        key_source=source,
        prompt_tokens_estimate=draw(st.integers(0, 300_000)),
        excluded=excluded,
    )
    return Scenario(snapshot(*reps, sess=sess), req)

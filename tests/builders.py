"""Builders for hand-made policy inputs (snapshots, replicas, sessions, requests).

Defaults describe a healthy, idle, ACTIVE replica with a known 850k-token capacity, so each test
states only the facts it is about.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.model import (
    ClusterSnapshot,
    EngineLoad,
    KeySource,
    ReplicaId,
    ReplicaState,
    ReplicaStatus,
    RouteRequest,
    SessionState,
)

__all__ = ["fleet", "replica", "request", "session", "snapshot"]

CAPACITY = 850_000


def replica(
    rid: ReplicaId,
    *,
    status: ReplicaStatus = ReplicaStatus.ACTIVE,
    in_flight: int = 0,
    queued: int = 0,
    running: int = 0,
    kv_util: float = 0.0,
    sessions: int = 0,
    active_ctx: int = 0,
    written: int = 0,
    capacity: int = CAPACITY,
    host: int = 0,
    placed: int = 0,
    joined_at: float = 0.0,
    engine_updated_at: float = 1.0,
    horizon: int = 0,
) -> ReplicaState:
    return ReplicaState(
        id=rid,
        url=f"http://{rid}",
        status=status,
        joined_at=joined_at,
        in_flight=in_flight,
        engine=EngineLoad(
            running=running,
            queued=queued,
            kv_util=kv_util,
            capacity_tokens=capacity,
            updated_at=engine_updated_at,
        ),
        capacity_tokens=capacity,
        host_capacity_tokens=host,
        sessions_active=sessions,
        active_context_tokens=active_ctx,
        tokens_written=written,
        placed_recent=placed,
        residency_horizon_tokens=horizon,
    )


def fleet(n: int, prefix: str = "r", **kw: object) -> tuple[ReplicaState, ...]:
    return tuple(replica(f"{prefix}{i:02d}", **kw) for i in range(n))  # type: ignore[arg-type]


def session(
    sid: str,
    home: ReplicaId | None,
    *,
    overflow: tuple[ReplicaId, ...] = (),
    in_flight: Mapping[ReplicaId, int] | None = None,
    ctx: int = 50_000,
    mark: int = 0,
    turns: int = 1,
    last_seen: float = 0.0,
    chains: tuple[tuple[str, ReplicaId], ...] = (),
) -> SessionState:
    return SessionState(
        session_id=sid,
        home=home,
        overflow=overflow,
        in_flight=tuple(sorted((r, n) for r, n in (in_flight or {}).items() if n > 0)),
        context_tokens=ctx,
        last_seen=last_seen,
        residency_mark=mark,
        turns=turns,
        chains=chains,
    )


def snapshot(
    *replicas: ReplicaState,
    sess: SessionState | None = None,
    now: float = 1000.0,
    seq: int = 0,
    sessions_active: int | None = None,
    serving_since: float | None = 0.0,
) -> ClusterSnapshot:
    """``serving_since`` 0: the store has routed since t = 0, so a replica with ``joined_at`` > 0
    joined by scale-up."""
    reps = tuple(sorted(replicas, key=lambda r: r.id))
    total = sum(r.sessions_active for r in reps) if sessions_active is None else sessions_active
    return ClusterSnapshot(
        now=now, replicas=reps, session=sess, seq=seq, sessions_active=total, serving_since=serving_since
    )


def request(
    key: str | None = "s1",
    *,
    source: KeySource = KeySource.HEADER,
    excluded: frozenset[ReplicaId] | set[ReplicaId] = frozenset(),
    prompt: int = 0,
    route: str = "/v1/chat/completions",
    chain: str | None = None,
) -> RouteRequest:
    return RouteRequest(
        session_key=key,
        key_source=source if key is not None else KeySource.NONE,
        route=route,
        prompt_tokens_estimate=prompt,
        excluded=frozenset(excluded),
        chain_key=chain,
    )

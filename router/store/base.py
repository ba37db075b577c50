"""The state-store seam: all shared-state knowledge lives behind this Protocol.

Rules:
  1. ``acquire`` performs a decision's effects *and* counts the request in flight in one atomic
     step (one Redis round trip); a first bind is compare-and-set, so racing gateways agree.
  2. ``release`` is called exactly once per successful ``acquire``, whatever happened to the request
     (completed, failed, client gone); it feeds what the response taught us back into the session.
  3. Stores never raise foreign errors: the Redis store maps them to ``StoreError`` or degrades.
  4. A decision the store cannot apply raises a ``router.errors.StaleViewError``: the replica it names
     is not registered (``ReplicaNotFoundError``, from ``acquire`` and ``set_status``) or another
     gateway moved the session (``StaleSessionError``). Nothing was applied; route again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from router.model import (
    ClusterSnapshot,
    Completion,
    EngineLoad,
    Lease,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
)

__all__ = ["StateStore", "StoreConfig"]

@dataclass(frozen=True, slots=True)
class StoreConfig:
    session_ttl_s: float = 3600.0  # a binding idle this long is forgotten
    active_window_s: float = 60.0  # a session seen within this window counts as active on its home
    ramp_window_s: float = 10.0  # placements per replica are counted over this window (ramp cap)
    lease_ttl_s: float = 10.0  # Redis: a gateway's in-flight counts die this long after its last heartbeat
    replica_ttl_s: float = 5.0  # Redis: registry entries written by sidecars expire after this
    key_prefix: str = "kvroute"  # Redis key prefix


@runtime_checkable
class StateStore(Protocol):
    async def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        """All replicas plus the given session's state (``None`` if unknown)."""
        ...

    async def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        """Apply the decision's effects and count the request in flight, atomically.

        If a ``BindSession`` compare-and-set fails (another gateway bound the session first), the
        lease names the winning home and ``disagreement`` is set. ``ReplicaNotFoundError`` if the
        target is not registered, ``StaleSessionError`` if the session moved (rule 4).
        """
        ...

    async def release(self, lease: Lease, completion: Completion) -> None:
        """The request ended. Decrement in flight; learn context size and residency."""
        ...

    async def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        """Register or update a replica. New replicas start as ``status`` (default JOINING)."""
        ...

    async def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        """``ReplicaNotFoundError`` if the replica is not registered."""
        ...

    async def remove_replica(self, replica_id: ReplicaId) -> None: ...

    async def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None: ...

    async def replicas(self) -> tuple[ReplicaState, ...]: ...

    async def session(self, session_id: str) -> SessionState | None: ...

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        """Sessions whose home is ``replica_id`` (admin view, drain)."""
        ...

    async def close(self) -> None: ...

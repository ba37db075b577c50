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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from router.model import (
    ClusterSnapshot,
    Completion,
    EngineLoad,
    HealthStamp,
    Lease,
    PinKind,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
)
from router.policy.breaks import found_resident

__all__ = [
    "PLAUSIBLE_EVICTION",
    "StateStore",
    "StoreConfig",
    "learn_horizon",
    "residency_feedback",
]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    session_ttl_s: float = 3600.0  # a binding (or a pin) idle this long is forgotten
    active_window_s: float = 60.0  # a session seen within this window counts as active on its home
    ramp_window_s: float = 10.0  # placements per replica are counted over this window (ramp cap)
    lease_ttl_s: float = 10.0  # Redis: a gateway's in-flight counts die this long after its last heartbeat
    replica_ttl_s: float = 5.0  # Redis: registry entries written by sidecars expire after this
    key_prefix: str = "kvroute"  # Redis key prefix


PLAUSIBLE_EVICTION = 0.5
"""A miss lowers a replica's residency horizon only when at least this fraction of the current
horizon (or of its capacity, before any is learned) was written since the session's last turn: an
LRU pool does not drop a session's prefix after far less than it holds, and a request whose prompt
differs from its session's context in ways the usage cannot show (a rewritten tool result, a
sub-agent's turn of the same size) must not drag the horizon down. Repeated misses still walk it
down by up to half a step each."""


def residency_feedback(lease: Lease, completion: Completion) -> bool | None:
    """Rule 6 feedback of one response that ran on the session's home: was the session's previous
    context still cached there? ``True``: all of it (``found_resident``); ``False``: not even half of
    it; ``None``: no clear evidence (failed, no usage reported, a request that does not continue the
    session's context (``router.policy.breaks.continues_context``), or a partial hit)."""
    if not completion.ok or completion.prompt_tokens is None or completion.cached_tokens is None:
        return None
    found = found_resident(lease.prev_context_tokens, completion.prompt_tokens, completion.cached_tokens)
    if found is None or found:
        return found
    expected = min(lease.prev_context_tokens, completion.prompt_tokens)
    return False if completion.cached_tokens < 0.5 * expected else None


def learn_horizon(horizon: int, written_since: int, found: bool, capacity_tokens: int = 0) -> int:
    """A replica's residency horizon after one observation (0 = none learned: the policy uses its
    capacity, ``capacity_tokens`` = HBM + host here, 0 if unknown). A session's cache found gone after
    ``written_since`` tokens puts the horizon below that (if plausible: ``PLAUSIBLE_EVICTION``); one
    still there puts a learned horizon at least that high."""
    if written_since <= 0:
        return horizon
    if not found:
        ref = horizon or capacity_tokens
        below = horizon == 0 or written_since < horizon
        return written_since if below and written_since >= PLAUSIBLE_EVICTION * ref else horizon
    return written_since if 0 < horizon < written_since else horizon


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

    async def report_health(self, stamps: Mapping[ReplicaId, HealthStamp]) -> None:
        """Share good health checks (discovery rule 7); a stamp of an unregistered replica is dropped."""
        ...

    async def health_stamps(self) -> Mapping[ReplicaId, HealthStamp]:
        """The last shared good health check of every registered replica that has one."""
        ...

    async def probers(self) -> tuple[str, ...]:
        """The live gateways sharing this store, by their prober ids (sorted), among which the
        replicas' probing is divided (discovery rule 8); ``()`` when the store serves one gateway."""
        ...

    async def replicas(self) -> tuple[ReplicaState, ...]: ...

    async def session(self, session_id: str) -> SessionState | None: ...

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        """Sessions whose home is ``replica_id`` (admin view, drain)."""
        ...

    async def pin(self, kind: PinKind, name: str, replica_id: ReplicaId) -> None:
        """``name`` (an engine session, a stored response) lives on ``replica_id`` only, so every
        request naming it must go there. Forgotten after ``session_ttl_s`` without use."""
        ...

    async def pinned(self, kind: PinKind, name: str) -> ReplicaId | None:
        """The replica ``name`` is pinned to (its idle time restarts), ``None`` if unknown or
        expired. A pin outlives its replica's registration: the caller checks that."""
        ...

    async def reserve(self, kind: PinKind, name: str, replica_id: ReplicaId) -> bool:
        """``pin`` only if ``name`` is not pinned: ``False`` (nothing changed) when it is. Atomic
        across the gateways of one store, so of racing callers exactly one gets ``True``."""
        ...

    async def unpin(self, kind: PinKind, name: str) -> None: ...

    async def share_config(self, doc: str) -> int:
        """Share the policy config (``PATCH /admin/config``'s JSON) with every gateway of this store:
        its new generation (1, 2, ...). ``StoreError`` when it could not be shared."""
        ...

    async def shared_config(self, known: int) -> tuple[int, str | None]:
        """The shared policy config's generation, with its JSON only when that is not ``known``
        (``(0, None)``: none shared). A store that cannot be read answers ``(known, None)``."""
        ...

    async def close(self) -> None: ...
